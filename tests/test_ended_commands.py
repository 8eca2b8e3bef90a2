"""A task that ends away from a safe point (its TTL runs out mid-step, an operator closes it,
a step fails) settles the steering commands still waiting for one: each is rejected, audited
and on the stream, never left pending on an ended task for ever (DESIGN §5: every accepted
command is applied or rejected)."""

from __future__ import annotations

import pytest

from conftest import FAST_LEASES, Processes, free_port, wait_until
from steering_app.models import CommandStatus, SteeringCommand
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Task, TaskEvent
from tests.test_steering_live import Api

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_task_past_its_ttl_mid_step_rejects_its_pending_commands(alice, processes: Processes) -> None:
    port = free_port()
    processes.web(port)
    processes.worker(concurrency=2, **FAST_LEASES)  # one runs the step, one the reaper
    processes.beat(**FAST_LEASES)
    api = Api(f"http://127.0.0.1:{port}", alice.token)
    # One long step: the TTL runs out while the worker is in it.
    task_id = api.create("noop", {"steps": 2, "sleepMs": 60_000}, ttlSeconds=20)
    wait_until(
        lambda: (
            Task.objects.get(id=task_id).lease_owner is not None and api.snapshot(task_id)["runtimeStatus"] == "working"
        ),
        timeout=30,
    )
    goal = api.steer(task_id, "adjust_goal", {"goal": "elsewhere"})
    assert goal.status_code == 202, goal.text
    pause = api.steer(task_id, "pause", reason="coffee")
    assert pause.status_code == 202, pause.text
    assert SteeringCommand.objects.filter(task_id=task_id, status=CommandStatus.PENDING).count() == 2

    wait_until(lambda: Task.objects.get(id=task_id).status == "failed", timeout=60)
    commands = {c.command_id: c for c in SteeringCommand.objects.filter(task_id=task_id)}
    for sent in (goal, pause):
        command = commands[sent.json()["commandId"]]
        assert command.status == CommandStatus.REJECTED, (command.type, command.status)
        assert "failed" in command.outcome
    task = Task.objects.get(id=task_id)
    assert verify_chain(task) is None
    rejected = AuditRecord.objects.filter(task=task, action="steering_rejected").count()
    assert rejected == 2
    events = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", "type"))
    assert [seq for seq, _ in events] == list(range(events[0][0], task.event_seq + 1))
    assert sum(1 for _, type in events if type == "steering.rejected") == 2
    # The history a client reads says so too.
    history = api.http.get(f"/runtime/tasks/{task_id}/steering").json()["results"]
    assert {c["status"] for c in history} == {"rejected"}
