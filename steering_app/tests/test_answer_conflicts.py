"""One answer stands: a second, different answer to an input request is a 409 carrying the
answer that stands; the same answer again is the original response. Over real HTTP (the
Django test client) on REST and the dashboard, which share steering's do_answer_input."""

from __future__ import annotations

import pytest
from django.test import Client

from conftest import make_persona
from steering_app.models import InputRequest, SteeringCommand
from tasks_app import engine
from tasks_app.models import Task
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db


def approval_waiting(persona) -> Task:
    """A task stopped at an approval (the noop agent asks "continue" at step 3)."""
    task = new_task(persona, steps=6)
    Task.objects.filter(id=task.id).update(input={"steps": 6, "askAt": 3})
    engine.run_slice(task.id, worker_id="w1")
    InputRequest.objects.filter(task_id=task.id, key="continue").update(
        kind="approval", answer_schema={"enum": ["approve", "reject"]}
    )
    assert Task.objects.get(id=task.id).status == "input_required"
    return task


def answer(persona, task: Task, value: str):
    return persona.client().post(f"/runtime/tasks/{task.id}/inputs/continue", {"answer": value}, format="json")


def test_one_answer_stands_the_same_again_is_a_replay_a_different_one_409(alice):
    april = make_persona("acme", "april", "approver")
    amos = make_persona("acme", "amos", "approver")
    task = approval_waiting(alice)
    first = answer(april, task, "approve")
    assert first.status_code == 202, first.content
    version = Task.objects.get(id=task.id).state_version
    again = answer(april, task, "approve")
    assert again.status_code == 202 and again.json() == first.json()
    # the same answer from a second approver is the same decision, not a conflict
    assert answer(amos, task, "approve").json() == first.json()
    second = answer(amos, task, "reject")
    assert second.status_code == 409, second.content
    error = second.json()["error"]
    assert error["code"] == "answer_conflict" and error["answer"] == "approve" and error["key"] == "continue"
    assert error["answeredBy"] == f"user:{april.user.pk}" and '"approve"' in error["message"]
    # nothing happened: one command, the version unmoved, the request keeps the first answer
    assert SteeringCommand.objects.filter(task_id=task.id).count() == 1
    assert Task.objects.get(id=task.id).state_version == version
    assert InputRequest.objects.get(task_id=task.id, key="continue").answer == "approve"


def test_an_answer_given_through_the_steering_endpoint_stands_for_the_inputs_endpoint(alice):
    april = make_persona("acme", "april", "approver")
    task = approval_waiting(alice)
    version = Task.objects.get(id=task.id).state_version
    steered = april.client().post(
        f"/runtime/tasks/{task.id}/steering",
        {
            "commandId": "mine",
            "type": "provide_input",
            "payload": {"key": "continue", "answer": "approve"},
            "expectedVersion": version,
        },
        format="json",
    )
    assert steered.status_code == 202, steered.content
    conflict = answer(april, task, "reject")
    assert conflict.status_code == 409 and conflict.json()["error"]["commandId"] == "mine"
    same = answer(april, task, "approve")
    assert same.status_code == 202 and same.json()["commandId"] == "mine"
    # and a second command on the steering endpoint gets the same 409
    again = april.client().post(
        f"/runtime/tasks/{task.id}/steering",
        {
            "commandId": "other",
            "type": "provide_input",
            "payload": {"key": "continue", "answer": "reject"},
            "expectedVersion": Task.objects.get(id=task.id).state_version,
        },
        format="json",
    )
    assert again.status_code == 409 and again.json()["error"]["answer"] == "approve"


def test_the_dashboard_shows_the_answer_that_stands(alice):
    april = make_persona("acme", "april", "approver")
    amos = make_persona("acme", "amos", "approver")
    task = approval_waiting(alice)
    assert answer(april, task, "approve").status_code == 202
    amos.user.set_password("pw")
    amos.user.save()
    browser = Client()
    assert browser.login(username="amos", password="pw")
    page = browser.post(f"/dashboard/tasks/{task.id}/inputs/continue", {"answer": "reject"}, follow=True)
    text = page.content.decode()
    assert "already has the answer" in text and "approve" in text and "reject sent" not in text
    assert SteeringCommand.objects.filter(task_id=task.id).count() == 1
    same = browser.post(f"/dashboard/tasks/{task.id}/inputs/continue", {"answer": "approve"}, follow=True)
    assert "continue: approve sent" in same.content.decode()
