"""Steering through the REST API with the engine run in-process (real PostgreSQL)."""

from __future__ import annotations

import json

import pytest

from checkpoints_app.models import Checkpoint
from runtime_site.blobstore import blob_store
from steering_app.models import InputRequest, SteeringCommand
from tasks_app import engine, leases, operators
from tasks_app.agents.document_review.corpus import generate_corpus
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Step, Task
from tasks_app.tests.test_engine import new_task, run_to_end

pytestmark = pytest.mark.django_db


def steer(persona, task, type, payload=None, *, version=None, command_id=None, reason=""):
    version = version if version is not None else Task.objects.get(id=task.id).state_version
    body = {
        "commandId": command_id or f"{type}-{version}",
        "type": type,
        "payload": payload or {},
        "expectedVersion": version,
        "reason": reason,
    }
    return persona.client().post(f"/runtime/tasks/{task.id}/steering", body, format="json")


def mid_step(persona, settings) -> tuple[Task, leases.Lease]:
    """A 10-step task that ran a 3-step slice and that a second worker holds now, mid-step."""
    settings.RUNTIME_SLICE_STEPS = 3
    task = new_task(persona, steps=10)
    engine.run_slice(task.id, worker_id="w1")
    lease = leases.claim(task.id, worker_id="w2", ttl=30)
    assert lease is not None
    return task, lease


def to_the_safe_point(lease: leases.Lease) -> engine.SliceOutcome:
    """The worker holding `lease` loads the task as it is now and goes on with its slice."""
    heartbeat = leases.Heartbeat(lease, ttl=30, interval=10, abandon=operators.do_abandon_step)
    return engine._loop(engine._load(lease), heartbeat)


def test_accept_answers_202_with_the_new_version_and_a_replay_gets_the_original_answer(alice):
    task = new_task(alice)
    first = steer(alice, task, "set_priority", {"priority": 1}, command_id="c1")
    assert first.status_code == 202, first.content
    assert first.json()["version"] == 2 and first.json()["status"] == "applied"
    steer(alice, task, "set_priority", {"priority": 7}, command_id="c2")
    replay = steer(alice, task, "set_priority", {"priority": 1}, command_id="c1", version=1)
    assert replay.status_code == 202 and replay.json() == first.json()
    assert Task.objects.get(id=task.id).priority == 7
    listed = alice.client().get(f"/runtime/tasks/{task.id}/steering").json()["results"]
    assert [c["commandId"] for c in listed] == ["c1", "c2"]


def test_a_stale_version_is_409_with_the_current_snapshot(alice):
    task = new_task(alice)
    steer(alice, task, "set_priority", {"priority": 1}, version=1)
    stale = steer(alice, task, "set_priority", {"priority": 2}, version=1, command_id="late")
    assert stale.status_code == 409
    error = stale.json()["error"]
    assert error["code"] == "version_conflict" and error["currentVersion"] == 2
    assert error["snapshot"]["taskId"] == str(task.id) and error["snapshot"]["stateVersion"] == 2
    assert not SteeringCommand.objects.filter(command_id="late").exists()


@pytest.mark.parametrize(
    ("type", "payload", "status", "needle"),
    [
        ("teleport", {}, 400, "teleport"),
        ("set_priority", {"priority": 12}, 422, "priority"),
        ("set_priority", {}, 422, "priority"),
        ("pause", {"now": True}, 422, "now"),
        ("adjust_goal", {}, 422, "payload"),
        ("adjust_goal", {"constraints": {"speed": "max"}}, 422, "cannot be re-aimed"),
        ("resume", {}, 409, "resume applies to a paused task"),
        ("provide_input", {"key": "nope", "answer": 1}, 409, "no open input request"),
    ],
)
def test_invalid_commands_are_refused_naming_the_problem_and_store_nothing(alice, type, payload, status, needle):
    task = new_task(alice)
    response = steer(alice, task, type, payload)
    assert response.status_code == status, response.content
    assert needle in response.json()["error"]["message"]
    assert SteeringCommand.objects.count() == 0
    assert Task.objects.get(id=task.id).state_version == 1


def test_commands_on_a_terminal_task_are_409_and_viewers_and_strangers_are_kept_out(alice, victor, mallory):
    task = new_task(alice, steps=2)
    assert steer(victor, task, "pause").status_code == 403
    assert steer(mallory, task, "pause").status_code == 404
    run_to_end(task)
    response = steer(alice, task, "pause")
    assert response.status_code == 409 and "completed" in response.json()["error"]["message"]


def test_pause_on_an_idle_task_applies_at_once_and_resume_continues_from_the_checkpoint(alice, settings):
    settings.RUNTIME_SLICE_STEPS = 4
    task = new_task(alice, steps=10)
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE
    paused = steer(alice, task, "pause", reason="lunch")
    assert paused.json()["status"] == "applied"
    task.refresh_from_db()
    assert (
        task.status == "paused"
        and task.mcp_status == "working"
        and task.status_text() == f"paused by user:{alice.user.pk}"
    )
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DROPPED  # no step while paused
    assert Step.objects.filter(task=task).count() == 4
    steer(alice, task, "resume")
    run_to_end(task)
    task.refresh_from_db()
    assert task.status == "completed" and Step.objects.filter(task=task).count() == 10
    assert task.events.filter(type="steering.applied").count() == 2
    assert verify_chain(task) is None


def test_pause_under_a_live_lease_is_acknowledged_then_applied_at_the_safe_point(alice, settings):
    task, lease = mid_step(alice, settings)  # a worker is mid-step
    accepted = steer(alice, task, "pause")
    assert accepted.json()["status"] == "pending"
    assert Task.objects.get(id=task.id).status == "pausing"
    # the worker reaches its next safe point
    assert to_the_safe_point(lease) is engine.SliceOutcome.DONE
    task.refresh_from_db()
    command = SteeringCommand.objects.get(task=task)
    assert task.status == "paused" and task.lease_owner is None and command.status == "applied"
    cp = Checkpoint.objects.filter(task=task).order_by("-id").first()
    assert cp.reason == "pause" and cp.steering_cursor == command.version and cp.sequence == 3
    assert Step.objects.filter(task=task).count() == 3  # nothing after the pause


def test_cancel_pending_under_a_lease_lands_at_the_safe_point_with_the_reason(alice, settings):
    task, lease = mid_step(alice, settings)  # a worker is mid-step
    steer(alice, task, "cancel", reason="wrong customer")
    assert Task.objects.get(id=task.id).status == "working"
    to_the_safe_point(lease)
    task.refresh_from_db()
    assert task.status == "cancelled" and task.cancel_reason == "wrong customer"
    assert AuditRecord.objects.filter(task=task, to_status="cancelled", reason="wrong customer").exists()


def test_provide_input_answers_what_the_agent_asked(alice):
    task = new_task(alice, steps=6)
    Task.objects.filter(id=task.id).update(input={"steps": 6, "askAt": 3})
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DONE
    task.refresh_from_db()
    assert task.status == "input_required" and task.mcp_status == "input_required"
    assert Step.objects.filter(task=task).count() == 2
    snapshot = alice.client().get(f"/runtime/tasks/{task.id}").json()
    assert snapshot["inputRequests"] == [
        {"key": "continue", "prompt": "Continue with step 3 of 6?", "schema": {"type": "boolean"}}
    ]
    assert task.events.filter(type="input_required").exists()
    bad = steer(alice, task, "provide_input", {"key": "continue", "answer": "yes please"})
    assert bad.status_code == 422 and "answer" in bad.json()["error"]["message"]
    assert steer(alice, task, "provide_input", {"key": "continue", "answer": False}).status_code == 202
    assert Task.objects.get(id=task.id).status == "working"
    run_to_end(task)
    task.refresh_from_db()
    assert task.status == "completed" and task.result == {"steps": 2}  # the person said stop
    assert InputRequest.objects.get(task=task).answered_by == f"user:{alice.user.pk}"


def test_adjust_goal_changes_the_remaining_work_of_the_review(alice, settings):
    store = blob_store()
    generate_corpus(store, "corpora/adjust", 100, 5, "2026-11-01")
    truth = json.loads(store.get("corpora/adjust/truth.json"))
    settings.RUNTIME_SLICE_STEPS = 3  # load_manifest + 2 batches of 10 = 20 documents
    task = (
        alice.client()
        .post(
            "/runtime/tasks",
            {
                "agent": "document_review",
                "input": {"corpus": "corpora/adjust", "batchSize": 10},
                "goal": "find risky contracts",
            },
            format="json",
        )
        .json()
    )
    task = Task.objects.get(id=task["taskId"])
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE
    response = steer(
        alice,
        task,
        "adjust_goal",
        {"goal": "prioritise compliance risk, exclude expired contracts", "constraints": {"excludeExpired": True}},
    )
    assert response.status_code == 202
    assert Task.objects.get(id=task.id).plan_version == 2
    run_to_end(task)
    task.refresh_from_db()
    docs = truth["documents"]
    expired_later = sum(1 for i, (_, d) in enumerate(sorted(docs.items())) if i >= 20 and d["expired"])
    assert task.result["documentsReviewed"] == 100 - expired_later
    assert task.result["skipped"] == expired_later
    assert Checkpoint.objects.filter(task=task).order_by("-id").first().plan_version == 2


def test_an_approver_may_extend_a_used_up_budget_or_stop_the_task(alice, settings):
    from conftest import make_persona

    april = make_persona("acme", "april", "approver")
    settings.RUNTIME = {**settings.RUNTIME, "budget": {**settings.RUNTIME["budget"], "on_exhausted": "ask"}}
    task = new_task(alice, steps=8, budget={"maxSteps": 2})
    run_to_end(task)
    task.refresh_from_db()
    assert task.status == "input_required" and task.steps_done == 2
    request = InputRequest.objects.get(task=task)
    assert request.key == "budget-step-3" and request.kind == "budget_extension" and "maxSteps" in request.prompt
    assert steer(alice, task, "provide_input", {"key": request.key, "answer": {"maxSteps": 5}}).status_code == 403
    assert steer(april, task, "provide_input", {"key": request.key, "answer": {"maxSteps": "lots"}}).status_code == 422
    assert steer(april, task, "provide_input", {"key": request.key, "answer": {"maxSteps": 5}}).status_code == 202
    run_to_end(task)
    task.refresh_from_db()
    assert task.status == "input_required" and task.steps_done == 5  # extended once, used up again
    assert steer(april, task, "provide_input", {"key": "budget-step-6", "answer": "stop"}).status_code == 202
    run_to_end(task)
    task.refresh_from_db()
    assert task.status == "failed" and task.error["code"] == "budget_exhausted" and task.steps_done == 5


@pytest.mark.parametrize("status", ["queued", "recovering"])
def test_a_pause_of_a_task_its_worker_claimed_but_has_not_started_lands_at_the_first_safe_point(
    alice, settings, status
):
    settings.RUNTIME_SLICE_STEPS = 3
    task = new_task(alice, steps=10)
    Task.objects.filter(id=task.id).update(status=status)  # claimed on arrival, or a recovery under way
    lease = leases.claim(task.id, worker_id="w1", ttl=30)
    accepted = steer(alice, task, "pause")  # was a 409: "a queued task cannot become pausing"
    assert accepted.status_code == 202, accepted.content
    assert accepted.json()["status"] == "pending"
    to_the_safe_point(lease)
    task.refresh_from_db()
    assert task.status == "paused" and SteeringCommand.objects.get(task=task).status == "applied"
    assert not Step.objects.filter(task=task).exists()  # the slice's start is its first safe point
    assert verify_chain(task) is None


def test_a_pause_waiting_on_a_claimed_task_may_be_taken_back_by_a_resume_and_is_not_asked_twice(alice, settings):
    settings.RUNTIME_SLICE_STEPS = 3
    task = new_task(alice, steps=10)
    lease = leases.claim(task.id, worker_id="w1", ttl=30)  # claimed, not started: it shows queued
    assert steer(alice, task, "pause", command_id="p1").status_code == 202
    again = steer(alice, task, "pause", command_id="p2")
    assert again.status_code == 409 and "already waiting" in again.json()["error"]["message"], again.content
    resumed = steer(alice, task, "resume", command_id="r1")  # was a 409: "resume applies to a paused task"
    assert resumed.status_code == 202, resumed.content
    to_the_safe_point(lease)
    task.refresh_from_db()
    commands = {c.command_id: c.status for c in SteeringCommand.objects.filter(task=task)}
    assert commands == {"p1": "applied", "r1": "applied"}
    assert task.status in ("working", "queued") and Step.objects.filter(task=task).count() == 3  # went on
    assert verify_chain(task) is None


def test_a_pause_after_a_pause_and_its_resume_mid_step_is_accepted_and_lands(alice, settings):
    # Seen live (adv3): pause, resume, pause while a worker's step ran; the third was refused
    # 409 "the task is already pausing" (the first pause had made it so), and the task went on
    # working although the last thing asked was a pause.
    task, lease = mid_step(alice, settings)  # a worker is mid-step
    assert steer(alice, task, "pause", command_id="p1").status_code == 202
    assert steer(alice, task, "resume", command_id="r1").status_code == 202
    resumed = steer(alice, task, "resume", command_id="r2")  # was accepted, then rejected at the safe point
    assert resumed.status_code == 409 and "already waiting" in resumed.json()["error"]["message"], resumed.content
    again = steer(alice, task, "pause", command_id="p2")
    assert again.status_code == 202, again.content
    twice = steer(alice, task, "pause", command_id="p3")
    assert twice.status_code == 409 and "already" in twice.json()["error"]["message"], twice.content
    to_the_safe_point(lease)
    task.refresh_from_db()
    commands = {c.command_id: c.status for c in SteeringCommand.objects.filter(task=task)}
    assert commands == {"p1": "applied", "r1": "applied", "p2": "applied"}
    assert task.status == "paused" and Step.objects.filter(task=task).count() == 3
    assert verify_chain(task) is None
