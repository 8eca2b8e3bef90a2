"""The REST edge: creation, idempotency, reads, cancel, and bad input (never a 500)."""

from __future__ import annotations

import json
import uuid

import pytest

from checkpoints_app.models import Checkpoint
from steering_app.models import InputRequest
from tasks_app.models import AuditRecord, Task

pytestmark = pytest.mark.django_db

NOOP = {"agent": "noop", "input": {"steps": 3}, "goal": "count to three"}


def create(persona, body=NOOP, **headers):
    return persona.client().post("/runtime/tasks", body, format="json", **headers)


def test_it_creates_a_task_and_answers_with_its_urls(alice):
    response = create(alice)
    assert response.status_code == 201, response.content
    body = response.json()
    task = Task.objects.get(id=body["taskId"])
    assert (task.tenant, task.agent, task.status) == (alice.tenant, "noop", "queued")
    assert body["status"] == "working" and body["runtimeStatus"] == "queued"
    assert body["statusUrl"] == f"/runtime/tasks/{task.id}"
    assert body["streamUrl"] == f"/runtime/tasks/{task.id}/events"
    assert AuditRecord.objects.filter(task=task, action="created").count() == 1
    assert task.events.filter(type="task.snapshot", seq=1).exists()


def test_same_idempotency_key_and_body_returns_the_same_task(alice):
    first = create(alice, HTTP_IDEMPOTENCY_KEY="batch-17")
    again = create(alice, HTTP_IDEMPOTENCY_KEY="batch-17")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["taskId"] == again.json()["taskId"]
    assert Task.objects.count() == 1


def test_same_idempotency_key_with_another_body_is_422(alice):
    create(alice, HTTP_IDEMPOTENCY_KEY="batch-17")
    other = create(alice, {**NOOP, "input": {"steps": 4}}, HTTP_IDEMPOTENCY_KEY="batch-17")
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert Task.objects.count() == 1


def test_idempotency_keys_are_per_tenant(alice, mallory):
    a = create(alice, HTTP_IDEMPOTENCY_KEY="k1").json()["taskId"]
    m = create(mallory, HTTP_IDEMPOTENCY_KEY="k1").json()["taskId"]
    assert a != m


def test_malformed_idempotency_key_is_400(alice):
    response = create(alice, HTTP_IDEMPOTENCY_KEY="has spaces and ünïcode")
    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()["error"]["message"]
    assert Task.objects.count() == 0


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({**NOOP, "agent": "no_such_agent"}, 422, "no_such_agent"),
        ({**NOOP, "input": {"steps": "many"}}, 422, "steps"),
        ({**NOOP, "input": {"steps": 3, "extra": 1}}, 422, "extra"),
        ({"input": {"steps": 3}}, 400, "agent"),
        ({**NOOP, "priority": 42}, 400, "priority"),
        ({**NOOP, "checkpointPolicy": {"everySteps": 0}}, 422, "everySteps"),
        ({**NOOP, "checkpointPolicy": {"sometimes": 1}}, 422, "sometimes"),
        ({**NOOP, "input": "not an object"}, 400, "input"),
        ({**NOOP, "budget": {"maxSteps": "ten"}}, 422, "maxSteps"),
        ({**NOOP, "budget": {"maxDollars": 3}}, 422, "maxDollars"),
        ({**NOOP, "approvalPolicy": {"before": "email.send"}}, 422, "before"),
        ({**NOOP, "approvalPolicy": {"before": ["emial.send"]}}, 422, "emial.send"),
    ],
)
def test_bad_bodies_are_refused_naming_the_problem(alice, body, status, needle):
    response = create(alice, body)
    assert response.status_code == status, response.content
    assert needle in response.json()["error"]["message"]
    assert Task.objects.count() == 0


def test_malformed_json_is_400(alice):
    response = alice.client().post("/runtime/tasks", "{not json", content_type="application/json")
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]


def test_oversized_body_is_413(alice, settings):
    body = {**NOOP, "goal": "x" * (settings.RUNTIME_MAX_BODY_BYTES + 10)}
    response = alice.client().post("/runtime/tasks", json.dumps(body), content_type="application/json")
    assert response.status_code == 413
    assert "limit" in response.json()["error"]["message"]
    assert Task.objects.count() == 0


def test_missing_or_wrong_api_key_is_401(alice):
    from rest_framework.test import APIClient

    anonymous = APIClient().post("/runtime/tasks", NOOP, format="json")
    assert anonymous.status_code == 401
    wrong = APIClient()
    wrong.credentials(HTTP_AUTHORIZATION=alice.token[:-3] + "xyz")
    assert wrong.get("/runtime/tasks").status_code == 401
    garbage = APIClient()
    garbage.credentials(HTTP_AUTHORIZATION="Basic Zm9vOmJhcg==")
    assert garbage.get("/runtime/tasks").status_code == 401


def test_a_viewer_may_read_but_not_create(victor):
    assert create(victor).status_code == 403
    assert victor.client().get("/runtime/tasks").status_code == 200


def test_another_tenants_task_is_404_everywhere(alice, mallory):
    task_id = create(alice).json()["taskId"]
    client = mallory.client()
    for path in ("", "/checkpoints", "/result", "/audit"):
        response = client.get(f"/runtime/tasks/{task_id}{path}")
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
    assert client.post(f"/runtime/tasks/{task_id}/cancel", {}, format="json").status_code == 404
    assert client.get("/runtime/tasks").json()["results"] == []
    assert Task.objects.get(id=task_id).status == "queued"


def test_unknown_and_malformed_task_ids_are_404(alice):
    client = alice.client()
    assert client.get(f"/runtime/tasks/{uuid.uuid4()}").status_code == 404
    assert client.get("/runtime/tasks/not-a-uuid").status_code == 404
    assert client.get("/runtime/nothing-here").json()["error"]["code"] == "not_found"


def test_detail_is_the_authoritative_snapshot(alice):
    task_id = create(alice).json()["taskId"]
    snap = alice.client().get(f"/runtime/tasks/{task_id}").json()
    for key in ("status", "runtimeStatus", "progress", "phase", "stateVersion", "lastCheckpoint", "updatedAt"):
        assert key in snap
    assert snap["lastCheckpoint"] is None and snap["stateVersion"] == 1


def test_list_filters_by_status_and_pages_with_a_cursor(alice):
    ids = [create(alice).json()["taskId"] for _ in range(5)]
    Task.objects.filter(id=ids[0]).update(status="completed")
    client = alice.client()
    page = client.get("/runtime/tasks?limit=2").json()
    seen = [t["taskId"] for t in page["results"]]
    while page["next"]:
        page = client.get(page["next"]).json()
        seen += [t["taskId"] for t in page["results"]]
    assert sorted(seen) == sorted(ids) and len(seen) == 5
    done = client.get("/runtime/tasks?status=completed").json()["results"]
    assert [t["taskId"] for t in done] == [ids[0]]
    bad = client.get("/runtime/tasks?status=sleeping")
    assert bad.status_code == 400 and "sleeping" in bad.json()["error"]["message"]


def _checkpoint(task: Task, sequence: int, *, discarded: bool = False) -> None:
    Checkpoint.objects.create(
        tenant=task.tenant,
        task=task,
        sequence=sequence,
        step_name=f"s{sequence}",
        schema_version=1,
        plan_version=1,
        state={},
        reason="every_steps",
        checksum="x",
        discarded=discarded,
    )


def _ask(task: Task, key: str, status: str = "open") -> None:
    InputRequest.objects.create(
        tenant=task.tenant, task=task, key=key, prompt=f"{key}?", step_sequence=1, status=status
    )


def test_a_snapshot_read_is_the_key_lookup_and_one_query(alice, django_assert_num_queries):
    """The newest checkpoint and whether an input is open come with the task row; the open
    requests are read only when there are some (it was four queries on every read)."""
    task = Task.objects.get(id=create(alice).json()["taskId"])
    _checkpoint(task, 4), _checkpoint(task, 7), _checkpoint(task, 9, discarded=True)
    client = alice.client()
    with django_assert_num_queries(2):  # the API key, the task
        snap = client.get(f"/runtime/tasks/{task.id}").json()
    assert (snap["lastCheckpoint"], snap["inputRequests"]) == (7, [])
    _ask(task, "b"), _ask(task, "a"), _ask(task, "old", status="answered")
    with django_assert_num_queries(3):  # ... and its open input requests
        snap = client.get(f"/runtime/tasks/{task.id}").json()
    assert [r["key"] for r in snap["inputRequests"]] == ["b", "a"]


def test_a_list_page_costs_the_same_queries_whatever_its_length(alice, django_assert_num_queries):
    """GET /runtime/tasks read two more queries per task (the N+1 of task_snapshot)."""
    tasks = [Task.objects.get(id=create(alice).json()["taskId"]) for _ in range(6)]
    for i, task in enumerate(tasks):
        _checkpoint(task, i + 1)
        _ask(task, f"q{i}")
    with django_assert_num_queries(3):  # the API key, the page, the page's open input requests
        page = alice.client().get("/runtime/tasks?limit=6").json()["results"]
    by_id = {t["taskId"]: t for t in page}
    assert [by_id[str(t.id)]["lastCheckpoint"] for t in tasks] == [1, 2, 3, 4, 5, 6]
    assert [[r["key"] for r in by_id[str(t.id)]["inputRequests"]] for t in tasks] == [[f"q{i}"] for i in range(6)]


def test_cancel_of_an_unleased_task_is_immediate_and_audited(alice):
    task_id = create(alice).json()["taskId"]
    response = alice.client().post(f"/runtime/tasks/{task_id}/cancel", {"reason": "changed my mind"}, format="json")
    assert response.status_code == 202
    assert response.json()["status"] == "cancelled"
    task = Task.objects.get(id=task_id)
    assert task.status == "cancelled" and task.lease_epoch == 1  # epoch moved: fences any zombie
    record = AuditRecord.objects.get(task=task, to_status="cancelled")
    assert (record.actor, record.reason) == (f"user:{alice.user.pk}", "changed my mind")
    again = alice.client().post(f"/runtime/tasks/{task_id}/cancel", {}, format="json")
    assert again.status_code == 409


def test_result_is_409_until_the_task_is_finished(alice):
    task_id = create(alice).json()["taskId"]
    response = alice.client().get(f"/runtime/tasks/{task_id}/result")
    assert response.status_code == 409 and response.json()["error"]["code"] == "not_finished"


def test_the_openapi_schema_is_served(client):
    response = client.get("/runtime/schema", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    assert "/runtime/tasks" in response.json()["paths"]


def test_the_briefs_tool_names_in_an_approval_policy_mean_our_tools(alice):
    response = create(alice, {**NOOP, "approvalPolicy": {"before": ["send_email", "publish_report", "http.request"]}})
    assert response.status_code == 201, response.content
    task = Task.objects.get(id=response.json()["taskId"])
    assert task.approval_policy == {"before": ["email.send", "content.publish", "http.request"]}
