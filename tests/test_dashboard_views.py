"""The dashboard's views through Django's test client: sessions, tenant scoping, and that
every change goes through the domain function the REST API uses."""

from __future__ import annotations

from unittest import mock

import pytest

from conftest import make_persona
from dashboard import views
from steering_app.models import InputRequest, SteeringCommand
from tasks_app.models import AuditRecord, Task
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db(transaction=True)


def signed_in(client, persona):
    persona.user.set_password("pw")
    persona.user.save()
    assert client.login(username=persona.user.username, password="pw")
    return client


def test_pages_need_a_session_and_the_root_leads_to_the_dashboard(client):
    assert client.get("/")["Location"] == "/dashboard/"
    response = client.get("/dashboard/")
    assert response.status_code == 302 and response["Location"].startswith("/dashboard/login/")
    assert client.get("/dashboard/login/").status_code == 200


def test_a_person_sees_only_their_tenants_tasks_in_pages_snapshots_and_streams(alice, mallory, client):
    ours, theirs = new_task(alice), new_task(mallory)
    signed_in(client, alice)
    listing = client.get("/dashboard/").content.decode()
    assert str(ours.id) in client.get("/dashboard/tasks.json").content.decode()
    assert str(theirs.id) not in listing and str(theirs.id) not in client.get("/dashboard/tasks.json").content.decode()
    assert client.get(f"/dashboard/tasks/{ours.id}/").status_code == 200
    assert client.get(f"/dashboard/tasks/{theirs.id}/").status_code == 404
    assert client.get(f"/dashboard/tasks/{theirs.id}/snapshot").status_code == 404
    assert client.post(f"/dashboard/tasks/{theirs.id}/steer", {
        "type": "pause", "expected_version": "1", "command_id": "x"}).status_code == 404
    # the one SSE endpoint takes the session too, scoped the same way
    assert client.get(f"/runtime/tasks/{theirs.id}/events").status_code == 404
    snapshot = client.get(f"/dashboard/tasks/{ours.id}/snapshot").json()
    assert snapshot["taskId"] == str(ours.id) and snapshot["seq"] >= 1


def test_the_stream_without_a_session_or_key_is_a_401(alice, client):
    task = new_task(alice)
    assert client.get(f"/runtime/tasks/{task.id}/events").status_code == 401


def test_steering_from_the_page_goes_through_do_enqueue_command_as_the_person(alice, client):
    task = new_task(alice)  # queued, no lease: a pause applies at once
    signed_in(client, alice)
    with mock.patch.object(views, "do_enqueue_command", wraps=views.do_enqueue_command) as spy:
        response = client.post(f"/dashboard/tasks/{task.id}/steer", {
            "type": "pause", "expected_version": str(task.state_version), "command_id": "dash-p1"})
    assert response.status_code == 302
    spy.assert_called_once()
    assert spy.call_args.kwargs["requested_by"] == f"user:{alice.user.pk}"
    assert Task.objects.get(id=task.id).status == "paused"
    command = SteeringCommand.objects.get(task=task)
    assert (command.command_id, command.status) == ("dash-p1", "applied")
    assert AuditRecord.objects.filter(task=task, action="steering_accepted", actor=f"user:{alice.user.pk}").exists()


def test_a_stale_version_is_a_409_that_shows_the_current_state(alice, client):
    task = new_task(alice)
    stale = task.state_version
    alice.client().post(f"/runtime/tasks/{task.id}/steering", {
        "commandId": "api-prio", "type": "set_priority", "payload": {"priority": 1}, "expectedVersion": stale},
        format="json")
    signed_in(client, alice)
    response = client.post(f"/dashboard/tasks/{task.id}/steer", {
        "type": "pause", "expected_version": str(stale), "command_id": "dash-late"})
    page = response.content.decode()
    assert response.status_code == 409
    assert "Someone changed this task; here is its current state." in page
    current = Task.objects.get(id=task.id)
    assert f'name="expected_version" value="{current.state_version}"' in page  # the form now carries it
    assert current.status == "queued" and not SteeringCommand.objects.filter(command_id="dash-late").exists()


def test_a_viewer_may_look_but_not_steer_or_start(victor, alice, client):
    task = new_task(alice)
    signed_in(client, victor)
    page = client.get(f"/dashboard/tasks/{task.id}/").content.decode()
    assert "Steering needs the operator role" in page and 'data-testid="pause"' not in page
    response = client.post(f"/dashboard/tasks/{task.id}/steer", {
        "type": "pause", "expected_version": str(task.state_version), "command_id": "v1"})
    assert response.status_code == 403 and Task.objects.get(id=task.id).status == "queued"
    assert client.get("/dashboard/tasks/new").status_code == 403


def test_approvals_use_the_same_answer_and_role_check_as_the_api(alice, client):
    april = make_persona("acme", "april", "approver")
    task = new_task(alice)
    Task.objects.filter(id=task.id).update(status="input_required")
    InputRequest.objects.create(tenant=alice.tenant, task=task, key="approve-publish", kind="approval",
                                prompt="publish the report?", answer_schema={"enum": ["approve", "reject"]},
                                step_sequence=1)
    signed_in(client, alice)  # an operator: may not approve
    response = client.post(f"/dashboard/tasks/{task.id}/inputs/approve-publish", {"answer": "approve"})
    assert response.status_code == 403 and "approver role" in response.content.decode()
    client.logout()
    signed_in(client, april)
    with mock.patch.object(views, "answer_input", wraps=views.answer_input) as spy:
        assert client.post(f"/dashboard/tasks/{task.id}/inputs/approve-publish",
                           {"answer": "approve"}).status_code == 302
    spy.assert_called_once()
    request = InputRequest.objects.get(task=task)
    assert (request.status, request.answer, request.answered_by) == ("answered", "approve", f"user:{april.user.pk}")
    assert Task.objects.get(id=task.id).status == "working"


def test_starting_a_review_goes_through_do_create_task_and_a_double_submit_is_one_task(alice, client):
    signed_in(client, alice)
    form = {"tenant": "acme", "corpus": "corpora/demo", "goal": "Find risky contracts", "limit": "40",
            "batch_size": "20", "pacing_ms": "0", "publish": "on", "priority": "5", "idempotency_key": "dash-k1"}
    with mock.patch.object(views, "do_create_task", wraps=views.do_create_task) as spy:
        first = client.post("/dashboard/tasks/new", form)
        second = client.post("/dashboard/tasks/new", form)
    assert spy.call_count == 2 and first.status_code == second.status_code == 302
    assert first["Location"] == second["Location"]
    task = Task.objects.get(tenant=alice.tenant, agent="document_review")
    assert task.input == {"corpus": "corpora/demo", "batchSize": 20, "pacingMs": 0, "publish": True, "limit": 40}
    assert task.created_by == f"user:{alice.user.pk}"
    bad = client.post("/dashboard/tasks/new", {**form, "corpus": "/absolute", "idempotency_key": "dash-k2"})
    assert bad.status_code == 400
