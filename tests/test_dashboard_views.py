"""The dashboard's views through Django's test client: sessions, tenant scoping, that every
change goes through the domain function the REST API uses, and that every form POST
answers with a redirect (post/redirect/get), so a reload never sends a command again."""

from __future__ import annotations

from unittest import mock

import pytest
from django.test import Client

from conftest import make_persona
from dashboard import views
from steering_app.models import InputRequest, SteeringCommand
from tasks_app.models import AuditRecord, Task
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db


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
    assert (
        client.post(
            f"/dashboard/tasks/{theirs.id}/steer", {"type": "pause", "expected_version": "1", "command_id": "x"}
        ).status_code
        == 404
    )
    # the one SSE endpoint takes the session too, scoped the same way
    assert client.get(f"/runtime/tasks/{theirs.id}/events").status_code == 404
    snapshot = client.get(f"/dashboard/tasks/{ours.id}/snapshot").json()
    assert snapshot["taskId"] == str(ours.id) and snapshot["seq"] >= 1


def test_the_stream_without_a_session_or_key_is_a_401(alice, client):
    task = new_task(alice)
    assert client.get(f"/runtime/tasks/{task.id}/events").status_code == 401


def test_a_signed_out_script_gets_a_401_and_a_signed_out_form_leads_to_sign_in_and_back(alice, client):
    task = new_task(alice)
    page = f"/dashboard/tasks/{task.id}/"
    # What dashboard.js fetches answers 401 (not the login page's HTML), so it can send the person there.
    for url in ("/dashboard/tasks.json", f"{page}snapshot", f"{page}panels"):
        response = client.get(url)
        assert response.status_code == 401, url
        assert response.json()["error"]["code"] == "not_authenticated"
    # A form posted after the session ended: sign in, then back to the task page (not the POST URL).
    response = client.post(f"{page}steer", {"type": "pause", "expected_version": "1", "command_id": "late"})
    assert response.status_code == 302 and response["Location"] == f"/dashboard/login/?next={page}"
    assert client.post(f"{page}inputs/approve-x", {"answer": "approve"})["Location"] == f"/dashboard/login/?next={page}"
    assert not SteeringCommand.objects.filter(task=task).exists()


def test_a_form_refused_for_its_csrf_token_leads_to_sign_in_or_back_to_the_page(alice):
    task = new_task(alice)
    page = f"/dashboard/tasks/{task.id}/"
    form = {"type": "pause", "expected_version": str(task.state_version), "command_id": "c1"}
    strict = Client(enforce_csrf_checks=True)
    response = strict.post(f"{page}steer", form)  # no session and no CSRF cookie left
    assert response.status_code == 302 and response["Location"] == f"/dashboard/login/?next={page}"
    signed_in(strict, alice)
    strict.cookies["csrftoken"] = "x" * 32  # a token from before the person signed in again
    response = strict.post(f"{page}steer", {**form, "csrfmiddlewaretoken": "y" * 32}, follow=True)
    assert response.redirect_chain == [(page, 303)]
    assert "older than your session, so nothing was sent" in response.content.decode()
    assert not SteeringCommand.objects.filter(task=task).exists()
    assert strict.post("/admin/login/", {}).status_code == 403  # elsewhere: Django's own CSRF page


def test_steering_from_the_page_goes_through_do_enqueue_command_as_the_person(alice, client):
    task = new_task(alice)  # queued, no lease: a pause applies at once
    signed_in(client, alice)
    with mock.patch.object(views, "do_enqueue_command", wraps=views.do_enqueue_command) as spy:
        response = client.post(
            f"/dashboard/tasks/{task.id}/steer",
            {"type": "pause", "expected_version": str(task.state_version), "command_id": "dash-p1"},
        )
    assert response.status_code == 303 and response["Location"] == f"/dashboard/tasks/{task.id}/"
    spy.assert_called_once()
    assert spy.call_args.kwargs["who"].actor == f"user:{alice.user.pk}"
    assert Task.objects.get(id=task.id).status == "paused"
    command = SteeringCommand.objects.get(task=task)
    assert (command.command_id, command.status) == ("dash-p1", "applied")
    assert AuditRecord.objects.filter(task=task, action="steering_accepted", actor=f"user:{alice.user.pk}").exists()


def test_a_stale_version_is_a_409_that_redirects_to_the_current_state(alice, client):
    task = new_task(alice)
    stale = task.state_version
    alice.client().post(
        f"/runtime/tasks/{task.id}/steering",
        {"commandId": "api-prio", "type": "set_priority", "payload": {"priority": 1}, "expectedVersion": stale},
        format="json",
    )
    signed_in(client, alice)
    with mock.patch.object(views, "do_enqueue_command", wraps=views.do_enqueue_command) as spy:
        response = client.post(
            f"/dashboard/tasks/{task.id}/steer",
            {"type": "pause", "expected_version": str(stale), "command_id": "dash-late"},
            follow=True,
        )
        assert response.redirect_chain == [(f"/dashboard/tasks/{task.id}/", 303)]
        page = response.content.decode()
        current = Task.objects.get(id=task.id)
        assert 'data-testid="conflict"' in page
        assert "<strong>Someone changed this task; here is its current state.</strong>" in page
        assert f"based on version {stale}; the task is now at version {current.state_version} (queued)" in page
        assert f'name="expected_version" value="{current.state_version}"' in page  # the form now carries it
        # Reloading the page the person landed on sends nothing and says it only once.
        again = client.get(f"/dashboard/tasks/{task.id}/").content.decode()
    assert spy.call_count == 1 and "Someone changed this task" not in again
    assert current.status == "queued" and not SteeringCommand.objects.filter(command_id="dash-late").exists()


def test_a_refused_command_is_a_flash_on_the_task_page(alice, client):
    task = new_task(alice)
    signed_in(client, alice)
    response = client.post(
        f"/dashboard/tasks/{task.id}/steer",
        {"type": "resume", "expected_version": str(task.state_version), "command_id": "r1"},
        follow=True,
    )
    assert response.redirect_chain == [(f"/dashboard/tasks/{task.id}/", 303)]
    assert 'data-testid="error"' in response.content.decode() and "resume was not accepted" in response.content.decode()
    garbled = client.post(f"/dashboard/tasks/{task.id}/steer", {"type": "explode"}, follow=True)
    assert "That command was not understood" in garbled.content.decode()


def test_a_viewer_may_look_but_not_steer_or_start(victor, alice, client):
    task = new_task(alice)
    signed_in(client, victor)
    page = client.get(f"/dashboard/tasks/{task.id}/").content.decode()
    assert "Steering needs the operator role" in page and 'data-testid="pause"' not in page
    response = client.post(
        f"/dashboard/tasks/{task.id}/steer",
        {"type": "pause", "expected_version": str(task.state_version), "command_id": "v1"},
        follow=True,
    )
    assert response.redirect_chain == [(f"/dashboard/tasks/{task.id}/", 303)]
    assert "Steering needs the operator role or above." in response.content.decode()
    assert Task.objects.get(id=task.id).status == "queued"
    assert client.get("/dashboard/tasks/new").status_code == 403


def test_approvals_use_the_same_answer_and_role_check_as_the_api(alice, client):
    april = make_persona("acme", "april", "approver")
    task = new_task(alice)
    Task.objects.filter(id=task.id).update(status="input_required")
    InputRequest.objects.create(
        tenant=alice.tenant,
        task=task,
        key="approve-publish",
        kind="approval",
        prompt="publish the report?",
        answer_schema={"enum": ["approve", "reject"]},
        step_sequence=1,
    )
    signed_in(client, alice)  # an operator: may not approve
    response = client.post(f"/dashboard/tasks/{task.id}/inputs/approve-publish", {"answer": "approve"}, follow=True)
    assert response.redirect_chain == [(f"/dashboard/tasks/{task.id}/", 303)]
    assert "approver role" in response.content.decode()
    client.logout()
    signed_in(client, april)
    with mock.patch.object(views, "do_answer_input", wraps=views.do_answer_input) as spy:
        assert (
            client.post(f"/dashboard/tasks/{task.id}/inputs/approve-publish", {"answer": "approve"}).status_code == 303
        )
    spy.assert_called_once()
    request = InputRequest.objects.get(task=task)
    assert (request.status, request.answer, request.answered_by) == ("answered", "approve", f"user:{april.user.pk}")
    assert Task.objects.get(id=task.id).status == "working"


def test_starting_a_review_goes_through_do_create_task_and_a_double_submit_is_one_task(alice, client):
    signed_in(client, alice)
    form = {
        "tenant": "acme",
        "corpus": "corpora/demo",
        "goal": "Find risky contracts",
        "limit": "40",
        "batch_size": "20",
        "pacing_ms": "0",
        "publish": "on",
        "priority": "5",
        "idempotency_key": "dash-k1",
    }
    with mock.patch.object(views, "do_create_task", wraps=views.do_create_task) as spy:
        first = client.post("/dashboard/tasks/new", form)
        second = client.post("/dashboard/tasks/new", form)
    assert spy.call_count == 2 and first.status_code == second.status_code == 303
    assert first["Location"] == second["Location"]
    task = Task.objects.get(tenant=alice.tenant, agent="document_review")
    assert task.input == {"corpus": "corpora/demo", "batchSize": 20, "pacingMs": 0, "publish": True, "limit": 40}
    assert task.created_by == f"user:{alice.user.pk}"
    # Refused: back to the form by a GET (a reload sends nothing), with the values and the reason.
    bad = client.post(
        "/dashboard/tasks/new", {**form, "corpus": "/absolute", "idempotency_key": "dash-k2"}, follow=True
    )
    assert bad.redirect_chain == [("/dashboard/tasks/new", 303)]
    page = bad.content.decode()
    assert 'value="/absolute"' in page and 'class="errorlist nonfield"' in page
    assert 'value="dash-k2"' not in page  # a fresh idempotency key for the next try
    assert "/absolute" not in client.get("/dashboard/tasks/new").content.decode()  # shown once
    # The same form sent again with other values (back button, edit, submit) starts nothing.
    reused = client.post("/dashboard/tasks/new", {**form, "limit": "41"}, follow=True)
    assert reused.redirect_chain == [("/dashboard/tasks/new", 303)]
    assert "This form already started a task with other values" in reused.content.decode()
    invalid = client.post("/dashboard/tasks/new", {**form, "batch_size": "0"}, follow=True)
    assert invalid.redirect_chain == [("/dashboard/tasks/new", 303)] and 'class="errorlist' in invalid.content.decode()
    assert Task.objects.filter(tenant=alice.tenant).count() == 1


def test_the_page_offers_only_the_commands_steering_would_accept(alice, client):
    signed_in(client, alice)
    task = new_task(alice)
    page = client.get(f"/dashboard/tasks/{task.id}/").content.decode()
    assert 'data-testid="pause"' in page and 'data-testid="resume"' not in page
    Task.objects.filter(id=task.id).update(status="dead_lettered")  # held for an operator: only cancel applies
    page = client.get(f"/dashboard/tasks/{task.id}/").content.decode()
    for control in ("pause", "resume", "set-priority", "adjust-goal"):
        assert f'data-testid="{control}"' not in page, control
    assert 'data-testid="cancel"' in page


def test_the_page_offers_what_steering_accepts_beside_the_commands_waiting(alice, client):
    """A worker holds the task mid-step: a pause accepted waits for its safe point (the task
    shows "pausing"); a resume may take it back, and a second pause is refused. Then, with
    the resume waiting after the pause, a pause is accepted again and a resume refused. The
    page offered the forms of the task's status alone: Pause with a resume waiting was hidden
    though the API accepts it."""
    from tasks_app import leases

    signed_in(client, alice)
    task = new_task(alice)
    assert leases.claim(task.id, worker_id="w1", ttl=600) is not None
    Task.objects.filter(id=task.id).update(status="working")

    def send(kind: str) -> None:
        version = Task.objects.get(id=task.id).state_version
        answer = client.post(
            f"/dashboard/tasks/{task.id}/steer",
            {"type": kind, "expected_version": version, "command_id": f"{kind}-{version}"},
        )
        assert answer.status_code == 303, answer

    def offered() -> set[str]:
        page = client.get(f"/dashboard/tasks/{task.id}/").content.decode()
        return {kind for kind in ("pause", "resume") if f'data-testid="{kind}"' in page}

    send("pause")
    assert offered() == {"resume"}
    send("resume")
    assert offered() == {"pause"}
    assert [c.status for c in SteeringCommand.objects.filter(task=task)] == ["pending", "pending"]


def test_the_task_page_shows_the_recoveries_in_a_row_that_max_recoveries_caps(alice, client):
    task = new_task(alice)
    Task.objects.filter(id=task.id).update(recoveries=5, recoveries_in_a_row=2)
    page = signed_in(client, alice).get(f"/dashboard/tasks/{task.id}/").content.decode()
    assert '<span data-testid="recoveries">5</span>' in page
    assert (
        '<span data-testid="recoveries-in-a-row" title="in a row without progress: max_recoveries caps these">2</span>'
        in page
    )
