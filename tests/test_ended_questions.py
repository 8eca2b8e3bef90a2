"""A task that ends while it waits for an answer waits for nothing: its open questions are
withdrawn with the ending, so no reader offers one whose answer is refused (the snapshot's
inputRequests, the dashboard's approve buttons). A killed task redriven to the same
question asks it again. In-process: the engine brings the task to its question here."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from steering_app.models import InputRequest, InputStatus
from tasks_app import engine
from tasks_app.access import console
from tasks_app.models import Task
from tasks_app.operators import do_expire_task, do_redrive_task
from tests.test_scope_rules import asking_task

pytestmark = pytest.mark.django_db(transaction=True)


def offered(persona, task: Task) -> tuple[list[str], bool]:
    """The questions the REST snapshot lists, and whether the dashboard shows answer buttons."""
    snapshot = persona.client().get(f"/runtime/tasks/{task.id}").json()
    browser = Client()
    browser.force_login(persona.user)
    page = browser.get(f"/dashboard/tasks/{task.id}/").content.decode()
    return [r["key"] for r in snapshot["inputRequests"]], 'data-testid="inputs"' in page


def test_a_task_cancelled_while_it_waits_offers_its_question_no_more(alice):
    task, key = asking_task(alice)
    assert offered(alice, task) == ([key], True)

    assert (
        alice.client().post(f"/runtime/tasks/{task.id}/cancel", {"reason": "not needed"}, format="json").status_code
        == 202
    )

    assert Task.objects.get(id=task.id).status == "cancelled"
    assert offered(alice, task) == ([], False)
    assert InputRequest.objects.get(task=task, key=key).status == InputStatus.WITHDRAWN
    answer = alice.client().post(f"/runtime/tasks/{task.id}/inputs/{key}", {"answer": True}, format="json")
    assert answer.status_code == 409


def test_a_task_past_its_ttl_while_it_waits_offers_its_question_no_more(alice):
    task, _ = asking_task(alice)
    Task.objects.filter(id=task.id).update(expires_at=timezone.now() - timedelta(seconds=1))

    assert do_expire_task(task.id, actor="beat") is not None

    assert Task.objects.get(id=task.id).status == "failed"
    assert offered(alice, task) == ([], False)


def test_a_killed_task_redriven_to_its_question_asks_it_again(alice):
    task, key = asking_task(alice)
    version = Task.objects.get(id=task.id).state_version
    killed = alice.client().post(
        f"/runtime/tasks/{task.id}/steering",
        {"commandId": "stop-1", "type": "kill", "payload": {}, "expectedVersion": version, "reason": "by mistake"},
        format="json",
    )
    assert killed.status_code == 202 and Task.objects.get(id=task.id).status == "cancelled"
    assert offered(alice, task) == ([], False)

    do_redrive_task(task.id, who=console(task.tenant, "admin:root"), reason="the kill was a mistake")
    engine.run_slice(task.id, worker_id="test")

    assert Task.objects.get(id=task.id).status == "input_required"
    assert offered(alice, task) == ([key], True)
    answer = alice.client().post(f"/runtime/tasks/{task.id}/inputs/{key}", {"answer": True}, format="json")
    assert answer.status_code == 202
