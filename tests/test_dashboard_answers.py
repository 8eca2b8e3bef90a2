"""The dashboard answers every kind of open question, not only approvals: each shows the
buttons its answer schema allows (an enum's values, yes/no for a boolean) or a field for the
answer as JSON, and what a button sends is what the REST API would be sent. Before, every
question showed Approve/Reject, and for a confirmation or an agent's own question both were
refused by its schema: a person on the dashboard could not answer it at all."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from steering_app.models import InputRequest, InputStatus
from tasks_app.models import Task
from tasks_app.tests.test_engine import new_task
from tests.test_scope_rules import asking_task

pytestmark = pytest.mark.django_db(transaction=True)


def browser(persona) -> Client:
    client = Client()
    client.force_login(persona.user)
    return client


def buttons(client: Client, task: Task) -> list[str]:
    page = client.get(f"/dashboard/tasks/{task.id}/").content.decode()
    return re.findall(r'<button name="answer" value="([^"]*)"', page)


def waiting_on(persona, *, key: str, kind: str, schema: dict) -> Task:
    task = new_task(persona)
    Task.objects.filter(id=task.id).update(status="input_required")
    InputRequest.objects.create(
        tenant=persona.tenant, task=task, key=key, kind=kind, prompt="?", answer_schema=schema, step_sequence=1
    )
    return task


def test_an_agents_yes_no_question_is_answered_from_the_dashboard(alice):
    task, key = asking_task(alice)
    client = browser(alice)
    assert buttons(client, task) == ["true", "false"]

    assert client.post(f"/dashboard/tasks/{task.id}/inputs/{key}", {"answer": "true"}).status_code == 303

    request = InputRequest.objects.get(task=task, key=key)
    assert (request.status, request.answer) == (InputStatus.ANSWERED, True)


def test_an_unknown_effect_is_confirmed_from_the_dashboard(alice):
    task = waiting_on(alice, key="confirm-x:1:1", kind="confirmation", schema={"enum": ["done", "not_done"]})
    client = browser(alice)
    assert buttons(client, task) == ["&quot;done&quot;", "&quot;not_done&quot;"]

    assert client.post(f"/dashboard/tasks/{task.id}/inputs/confirm-x:1:1", {"answer": '"not_done"'}).status_code == 303

    request = InputRequest.objects.get(task=task)
    assert (request.status, request.answer) == (InputStatus.ANSWERED, "not_done")


def test_a_question_without_choices_takes_its_answer_as_json_and_refuses_what_is_not(alice):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    task = waiting_on(alice, key="how-many", kind="question", schema=schema)
    client = browser(alice)
    page = client.get(f"/dashboard/tasks/{task.id}/").content.decode()
    assert buttons(client, task) == [] and 'data-testid="answer"' in page

    refused = client.post(f"/dashboard/tasks/{task.id}/inputs/how-many", {"answer": '{"n": NaN}'}, follow=True)
    assert refused.status_code == 200 and "NaN is not a JSON number" in refused.content.decode()
    wrong = client.post(f"/dashboard/tasks/{task.id}/inputs/how-many", {"answer": "three"}, follow=True)
    assert "was not accepted" in wrong.content.decode()
    assert InputRequest.objects.get(task=task).status == InputStatus.OPEN

    assert client.post(f"/dashboard/tasks/{task.id}/inputs/how-many", {"answer": '{"n": 3}'}).status_code == 303
    assert InputRequest.objects.get(task=task).answer == {"n": 3}


def test_a_question_that_wants_text_takes_what_was_typed_as_text_even_when_it_reads_as_json(alice):
    task = waiting_on(alice, key="code", kind="question", schema={"type": "string", "maxLength": 20})
    client = browser(alice)
    # 123 is JSON (a number), which the schema refuses; typed into a field that asks for text it is the text.
    assert client.post(f"/dashboard/tasks/{task.id}/inputs/code", {"answer": "123"}).status_code == 303
    request = InputRequest.objects.get(task=task)
    assert (request.status, request.answer) == (InputStatus.ANSWERED, "123")
