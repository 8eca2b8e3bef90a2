"""The built-in agent on the real engine: a review of a few hundred generated contracts
through the REST API, run by a real worker process on PostgreSQL and Redis."""

from __future__ import annotations

import json

import pytest

from conftest import Processes, wait_until
from runtime_site.blobstore import blob_store
from tasks_app.agents.document_review.corpus import generate_corpus
from tasks_app.audit import verify_chain
from tasks_app.models import Task

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_review_of_300_documents_completes_with_the_right_counts_and_a_report(alice, processes: Processes):
    store = blob_store()
    generate_corpus(store, "corpora/e2e", 300, 11, "2026-11-01")
    truth = json.loads(store.get("corpora/e2e/truth.json"))
    processes.worker(concurrency=2, RUNTIME_SLICE_STEPS="4")  # several slices, several hand-overs

    created = alice.client().post(
        "/runtime/tasks",
        {
            "agent": "document_review",
            "input": {"corpus": "corpora/e2e", "batchSize": 20},
            "goal": "Find risky contracts",
            "checkpointPolicy": {"everySteps": 3},
        },
        format="json",
    )
    assert created.status_code == 201, created.content
    task_id = created.json()["taskId"]
    wait_until(lambda: Task.objects.get(id=task_id).is_terminal, timeout=120, what="the review to finish")

    task = Task.objects.get(id=task_id)
    assert task.status == "completed", task.error
    result = alice.client().get(f"/runtime/tasks/{task_id}/result").json()["result"]
    assert result["documentsReviewed"] == 300
    assert result["byCategory"] == truth["totals"]["byCategory"]
    assert result["expired"] == truth["totals"]["expired"]
    assert sum(result["byLevel"].values()) == 300

    report = json.loads(store.get(result["report"]["json"].removeprefix("file://")))
    assert report["summary"]["documentsReviewed"] == 300
    assert report["summary"]["byCategory"] == truth["totals"]["byCategory"]
    markdown = store.get(result["report"]["markdown"].removeprefix("file://")).decode()
    assert "# " in markdown and "high" in markdown.lower()
    assert task.events.filter(type="artifact").count() == 2

    steps = list(task.steps.values_list("sequence", "attempt"))
    assert sorted(s for s, _ in steps) == list(range(1, task.steps_done + 1))
    assert {a for _, a in steps} == {1}
    checkpoints = alice.client().get(f"/runtime/tasks/{task_id}/checkpoints").json()["results"]
    assert all(cp["valid"] for cp in checkpoints)
    assert {cp["reason"] for cp in checkpoints} >= {"every_steps", "slice_end", "terminal"}
    assert verify_chain(task) is None
