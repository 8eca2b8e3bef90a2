"""The kill command (issue 18) at its edges, and on tasks nobody is running: REST, MCP and
the admin with the engine run in-process (real PostgreSQL). The running step's kill, with
real worker processes, is in tests/test_kill_running.py."""

from __future__ import annotations

import pytest

from checkpoints_app.actions import latest_checkpoint
from checkpoints_app.models import Checkpoint
from steering_app.models import SteeringCommand
from steering_app.tests.test_steering import steer
from tasks_app import engine, leases
from tasks_app.access import console
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Task, TaskEvent
from tasks_app.selectors import task_snapshot
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db


def kill(persona, task, reason="agent is spamming the CRM", **kwargs):
    return steer(persona, task, "kill", reason=reason, **kwargs)


def assert_killed(task_id, reason: str) -> Task:
    task = Task.objects.get(id=task_id)
    assert task.status == "cancelled" and task.kill_requested
    assert task.lease_owner is None
    snapshot = task_snapshot(task)
    assert snapshot["status"] == "cancelled" and snapshot["statusMessage"] == f"killed: {reason}"
    terminal = list(TaskEvent.objects.filter(task=task, type="terminal").values_list("data", flat=True))
    assert len(terminal) == 1 and terminal[0]["reason"] == f"killed: {reason}"
    assert AuditRecord.objects.filter(task=task, to_status="cancelled").get().reason == f"killed: {reason}"
    accepted = AuditRecord.objects.get(task=task, action="steering_accepted", data__type="kill")
    assert accepted.actor.startswith("user:") and accepted.reason == reason  # who, and why
    assert verify_chain(task) is None
    return task


def test_a_kill_of_a_paused_task_ends_it_at_once_and_keeps_its_checkpoint_loadable(alice):
    task = new_task(alice, steps=100)
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE  # yields with a checkpoint
    steer(alice, task, "pause")
    assert Task.objects.get(id=task.id).status == "paused"
    checkpoint = latest_checkpoint(task)
    assert checkpoint is not None

    answer = kill(alice, task)
    assert answer.status_code == 202, answer.content
    body = answer.json()
    assert body["type"] == "kill" and body["status"] == "applied"
    assert body["killPolicy"]["cut"] == ["http.request", "mcp.call", "llm.chat"]
    assert body["killPolicy"]["finishFirst"] == ["payment.create", "email.send"]
    assert_killed(task.id, "agent is spamming the CRM")
    assert latest_checkpoint(task).sequence == checkpoint.sequence  # still there, still verifies
    assert engine.run_slice(task.id, worker_id="w2") is engine.SliceOutcome.DROPPED  # nothing runs it again


def test_a_kill_of_a_task_waiting_for_input_ends_it_at_once(alice):
    from tasks_app.actions import do_create_task

    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 5, "askAt": 2})
    engine.run_slice(task.id, worker_id="w1")
    assert Task.objects.get(id=task.id).status == "input_required"
    assert kill(alice, task, reason="wrong customer").status_code == 202
    assert_killed(task.id, "wrong customer")


def test_a_kill_of_a_queued_task_ends_it_before_any_worker_claims_it(alice):
    task = new_task(alice)
    assert kill(alice, task).status_code == 202
    assert_killed(task.id, "agent is spamming the CRM")
    assert leases.claim(task.id, worker_id="w1", ttl=30) is None


def test_a_kill_of_a_finished_task_is_409_with_its_snapshot(alice):
    task = new_task(alice, steps=1)
    while engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE:
        pass
    assert Task.objects.get(id=task.id).status == "completed"
    answer = kill(alice, task)
    assert answer.status_code == 409, answer.content
    error = answer.json()["error"]
    assert error["code"] == "command_refused" and "completed" in error["message"]
    assert error["snapshot"]["taskId"] == str(task.id) and error["snapshot"]["runtimeStatus"] == "completed"
    assert not SteeringCommand.objects.filter(task=task, type="kill").exists()


def test_a_kill_of_another_tenants_task_is_404(alice, mallory):
    task = new_task(alice)
    assert kill(mallory, task).status_code == 404
    assert Task.objects.get(id=task.id).status == "queued"
    assert kill(alice, task).status_code == 202  # the same command from its own tenant


def test_a_kill_without_the_operator_role_is_403(alice, victor):
    task = new_task(alice)
    assert kill(victor, task).status_code == 403
    assert Task.objects.get(id=task.id).status == "queued"
    assert kill(alice, task).status_code == 202  # the same command from an operator


def test_a_kill_needs_a_reason_and_the_current_version(alice):
    task = new_task(alice)
    no_reason = kill(alice, task, reason=" ")
    assert no_reason.status_code == 422 and "reason" in no_reason.json()["error"]["message"]
    stale = kill(alice, task, version=7)
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "version_conflict"
    assert Task.objects.get(id=task.id).status == "queued"


def test_a_killed_task_can_be_redriven_by_an_operator_from_its_last_checkpoint(alice):
    from tasks_app.operators import do_redrive_task

    task = new_task(alice, steps=100)
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE  # checkpointed as it yields
    done = Checkpoint.objects.filter(task=task).order_by("-sequence").first().sequence
    kill(alice, task)
    do_redrive_task(task.id, who=console(task.tenant, "admin:root"), reason="the kill was a mistake")
    task = Task.objects.get(id=task.id)
    assert task.status == "recovering" and not task.kill_requested and not task.cancel_requested
    while engine.run_slice(task.id, worker_id="w2") is engine.SliceOutcome.CONTINUE:
        pass
    task = Task.objects.get(id=task.id)
    assert task.status == "completed" and task.result == {"steps": 100}
    assert task.steps.filter(sequence__lte=done, worker="w2").count() == 0  # resumed, not restarted


# the step runs on a worker thread with its own connection
@pytest.mark.django_db(transaction=True)
def test_a_kill_cuts_a_step_sleeping_in_the_agents_own_code_and_the_slice_returns(alice):
    import threading

    from django.db import connection

    from conftest import wait_until
    from steering_app.actions import do_enqueue_command
    from tasks_app.actions import do_create_task

    # A minute in time.sleep, inside the step.
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 1, "sleepMs": 60_000})
    failures: list[BaseException] = []

    def operator() -> None:
        try:
            wait_until(
                lambda: Task.objects.filter(id=task.id, status="working", lease_owner="w1").exists(),
                timeout=30,
                what="the step to run",
            )
            do_enqueue_command(
                task.id,
                who=console(alice.tenant, "user:test"),
                command_id="k1",
                type="kill",
                payload={},
                expected_version=Task.objects.get(id=task.id).state_version,
                reason="stuck",
            )
        except BaseException as exc:  # noqa: BLE001 (reported by the test's thread)
            failures.append(exc)
        finally:
            connection.close()

    helper = threading.Thread(target=operator)
    helper.start()
    outcome = engine.run_slice(task.id, worker_id="w1")  # here, in the main thread, as in a pool process
    helper.join()
    assert not failures, failures
    assert outcome is engine.SliceOutcome.DROPPED  # cut: the kill had ended the task and fenced the slice
    assert_killed(task.id, "stuck")
    assert not Task.objects.get(id=task.id).steps.exists()


def test_a_kill_of_a_running_task_settles_the_commands_still_waiting_for_its_safe_point(alice):
    # A worker holds the task (mid-step): a pause waits for its safe point, which the kill
    # takes away (the epoch moves, the worker never commits again). Nobody else would ever
    # settle the pause: it must not stay pending on a cancelled task.
    task = new_task(alice, steps=100)
    assert leases.claim(task.id, worker_id="w1", ttl=60) is not None
    Task.objects.filter(id=task.id).update(status="working")
    assert steer(alice, task, "pause", command_id="p1").json()["status"] == "pending"
    assert kill(alice, task, reason="runaway").json()["status"] == "applied"
    assert Task.objects.get(id=task.id).status == "cancelled"
    pause = SteeringCommand.objects.get(task=task, command_id="p1")
    assert pause.status == "rejected" and "cancelled" in pause.outcome
    assert not SteeringCommand.objects.filter(task=task, status="pending").exists()


# the MCP view closes its connection, which would end a test transaction
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("reason", [None, 7, {"why": "runaway"}, ["runaway"], "x" * 501])
def test_the_mcp_kill_tool_refuses_a_reason_that_is_no_reason_instead_of_making_one_up(alice, reason):
    import json

    from tests.test_hostile_input import mcp

    task = new_task(alice)
    arguments = {
        "taskId": str(task.id),
        "expectedVersion": Task.objects.get(id=task.id).state_version,
        "reason": reason,
    }
    response = mcp(
        alice.token,
        json.dumps(
            {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "kill_task", "arguments": arguments}}
        ),
    )
    # The tool's inputSchema says what a reason is: -32602 naming it (HTTP 200 on this, the 2025 wire).
    assert response.status_code == 200, response.content
    error = response.json()["error"]
    assert error["code"] == -32602 and "reason" in error["message"], error
    assert Task.objects.get(id=task.id).status == "queued"  # not killed for "None", "7" or a cut-off reason
