"""Every command type on a task in every state, with and without commands already waiting
and a cancel already asked for: whatever is accepted leaves the audit chain whole, every
accepted command settled exactly once (or pending) with its event, the event seqs contiguous,
and the answer's version the one a later read shows. (Adversarial review of the six-statement
accept, a3f849a: commands inserted settled, records written with events and with the row.)"""

from __future__ import annotations

import contextlib
from collections import Counter
from datetime import timedelta

import pytest
from django.utils import timezone

from ledger_app.models import EffectStatus, LedgerEntry
from steering_app.actions import do_enqueue_command
from steering_app.models import CommandStatus, InputRequest, SteeringCommand
from tasks_app.access import console
from tasks_app.audit import verify_chain
from tasks_app.errors import DomainError
from tasks_app.models import AuditRecord, Task, TaskEvent
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db

PAYLOADS = {
    "pause": {},
    "resume": {},
    "cancel": {},
    "kill": {},
    "adjust_goal": {"goal": "shorter", "constraints": {"maxDocs": 3}},
    "provide_input": {"key": "q", "answer": "yes"},
    "set_priority": {"priority": 1},
}
STATES = ["queued", "working", "pausing", "recovering", "paused", "input_required", "dead_lettered", "completed"]
BEFORE = ["none", "pause", "resume", "adjust_goal", "cancel_requested", "kill_waiting"]


def _steer(alice, task, type, n):
    fresh = Task.objects.get(id=task.id)
    return do_enqueue_command(
        task.id,
        who=console(alice.tenant, "user:t"),
        command_id=f"c{n}-{type}",
        type=type,
        payload=PAYLOADS[type],
        expected_version=fresh.state_version,
        reason="because",
    )


def check(task: Task) -> None:
    task = Task.objects.get(id=task.id)
    assert verify_chain(task) is None, verify_chain(task)
    seqs = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, task.event_seq + 1)), seqs
    accepted = Counter(
        r["commandId"]
        for r in AuditRecord.objects.filter(task=task, action="steering_accepted").values_list("data", flat=True)
    )
    settled = Counter(
        r["commandId"]
        for r in AuditRecord.objects.filter(
            task=task, action__in=["steering_applied", "steering_rejected"]
        ).values_list("data", flat=True)
    )
    events = Counter(
        e["commandId"]
        for e in TaskEvent.objects.filter(task=task, type__in=["steering.applied", "steering.rejected"]).values_list(
            "data", flat=True
        )
    )
    for command in SteeringCommand.objects.filter(task=task):
        assert accepted[command.command_id] == 1, command.command_id
        want = 0 if command.status == CommandStatus.PENDING else 1
        assert settled[command.command_id] == want, (command.command_id, command.status)
        assert events[command.command_id] == want, (command.command_id, command.status)
        assert command.version <= task.state_version
    assert sum(accepted.values()) == SteeringCommand.objects.filter(task=task).count()


def setup(alice, state, before):
    task = new_task(alice)
    live = {"lease_owner": "w1", "lease_epoch": 3, "lease_expires_at": timezone.now() + timedelta(minutes=5)}
    if state in ("working", "pausing"):
        Task.objects.filter(id=task.id).update(status=state, **live)
    elif state == "completed":
        Task.objects.filter(id=task.id).update(status=state, finished_at=timezone.now())
    else:
        Task.objects.filter(id=task.id).update(status=state)
    InputRequest.objects.create(tenant=alice.tenant, task=task, key="q", prompt="?", step_sequence=1)
    if before != "none":
        # Accepted while a worker held it (left pending), then the lease as the state says.
        Task.objects.filter(id=task.id).update(**live, status="working" if state != "pausing" else "pausing")
        if before == "resume":  # a pause then a resume, both waiting
            with contextlib.suppress(DomainError):
                _steer(alice, task, "pause", 0)
        if before == "kill_waiting":  # a kill waiting for a call that must finish (kill.finish_first)
            LedgerEntry.objects.create(
                tenant=alice.tenant, task=task, step_sequence=1, call_index=0, key=f"{task.id}:1:0",
                tool="payment.create", fingerprint="f", status=EffectStatus.STARTED, lease_epoch=3,
            )  # fmt: skip
        kind = {"cancel_requested": "cancel", "kill_waiting": "kill"}.get(before, before)
        with contextlib.suppress(DomainError):
            _steer(alice, task, kind, 0)
        restore: dict = {"status": state}
        if state not in ("working", "pausing"):
            restore.update(lease_owner=None, lease_expires_at=None)
        Task.objects.filter(id=task.id).update(**restore)
    return task


@pytest.mark.parametrize("before", BEFORE)
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("type", list(PAYLOADS))
def test_every_command_on_every_state_leaves_everything_whole(alice, type, state, before):
    task = setup(alice, state, before)
    check(task)
    was = Task.objects.get(id=task.id)
    try:
        command, created = _steer(alice, task, type, 1)
    except DomainError:
        check(task)
        after = Task.objects.get(id=task.id)
        assert (after.state_version, after.audit_seq, after.event_seq) == (
            was.state_version,
            was.audit_seq,
            was.event_seq,
        )
        return
    assert created
    check(task)
    after = Task.objects.get(id=task.id)
    row = SteeringCommand.objects.get(id=command.id)
    assert (row.status, row.outcome, row.version) == (command.status, command.outcome, command.version)
    assert (row.payload, row.reason, row.requested_by, row.type) == (PAYLOADS[type], "because", "user:t", type)
    assert command.version == after.state_version
    for settled in SteeringCommand.objects.filter(task=task, applied_at__isnull=False):
        # Accepted, then applied: an answer's createdAt after its appliedAt is a command applied before it was accepted.
        assert settled.created_at <= settled.applied_at, (settled.command_id, settled.created_at, settled.applied_at)
    assert after.updated_at > was.updated_at
    if row.status == CommandStatus.APPLIED and type == "adjust_goal":
        assert (after.goal, after.constraints["maxDocs"], after.plan_version) == ("shorter", 3, was.plan_version + 1)
    if row.status == CommandStatus.APPLIED and type == "set_priority":
        assert after.priority == 1
    if type in ("cancel", "kill") and row.status == CommandStatus.APPLIED:
        assert after.status == "cancelled" and after.lease_owner is None


@pytest.mark.django_db(transaction=True)  # threads, each on its own connection
@pytest.mark.parametrize(("state", "type"), [("working", "set_priority"), ("queued", "pause"), ("paused", "resume")])
@pytest.mark.parametrize("same_id", [True, False])
def test_concurrent_commands_at_one_version_accept_one(alice, state, type, same_id):
    import threading

    from django.db import connection

    task = setup(alice, state, "none")
    version = Task.objects.get(id=task.id).state_version
    start, results = threading.Barrier(6), []

    def send(n: int) -> None:
        try:
            start.wait()
            results.append(
                do_enqueue_command(
                    task.id,
                    who=console(alice.tenant, "user:t"),
                    command_id="same" if same_id else f"c{n}",
                    type=type,
                    payload=PAYLOADS[type],
                    expected_version=version,
                )
            )
        except DomainError as exc:
            results.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=send, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    created = [r for r in results if isinstance(r, tuple) and r[1]]
    assert len(results) == 6 and len(created) == 1, results
    if same_id:
        assert all(isinstance(r, tuple) and r[0].id == created[0][0].id for r in results), results
    check(task)
    assert SteeringCommand.objects.filter(task=task).count() == 1
