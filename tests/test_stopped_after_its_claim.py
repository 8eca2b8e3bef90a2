"""A worker stopped (SIGSTOP: a paused VM, a host that hangs) right after its claim, and run
again once another worker has taken the task over: its load settled the ledger rows a lost
worker had left started (ledger_app.actions.settle_interrupted) and, unfenced, marked the NEW
owner's call in flight unknown as well, as if that call had been lost. Found by the adv2
adversary. A load now settles only rows started under an older lease epoch than its own:
rows of its epoch or a newer one are not its to settle. The rest of the stopped worker's
load is fenced, so it writes nothing.

The exact interleaving, in-process and deterministic: each worker is the engine's own claim
(with the reads that go in its message, as run_slice_report sends them), load and loop, and
the reaper's recovery in between; the stop is simply the time between the stopped worker's
claim and its load.
"""

from __future__ import annotations

from typing import Any

import pytest

from ledger_app.models import LedgerEntry
from tasks_app import engine, leases, operators
from tasks_app.models import Step, Task
from tasks_app.tests.test_engine import expire_lease, new_task

pytestmark = pytest.mark.django_db


def claim(task: Task, worker: str) -> tuple[leases.Lease, Task, Any]:
    claimed = leases.claim_and_read(task.id, worker_id=worker, ttl=30, then=engine._reads_sql(task.id))
    assert claimed is not None, f"{worker} could not claim"
    return claimed


def in_flight(lease: leases.Lease, task: Task, sequence: int) -> LedgerEntry:
    """A call with side effects whose row the worker holding `lease` committed before sending it."""
    return LedgerEntry.objects.create(
        tenant=task.tenant, task=task, step_sequence=sequence, call_index=0, key=f"{task.id}:{sequence}:0",
        tool="http.request", fingerprint="f", status="started", lease_epoch=lease.epoch,
    )  # fmt: skip


def lose_the_lease(task: Task) -> None:
    expire_lease(task)
    assert operators.do_mark_recovering(task.id, actor="system:reaper", max_recoveries=10) is not None


def test_a_worker_stopped_after_its_claim_leaves_the_new_owners_call_in_flight_alone(alice):
    task = new_task(alice, steps=10)
    # A worker is lost in the middle of a call: its row stays started.
    lost, *_ = claim(task, "lost")
    assert engine._load(lost) is not None
    lost_call = in_flight(lost, task, 1)
    lose_the_lease(task)
    # The next worker claims the task, its reads going with the claim, and is stopped right
    # there: what it read says a lost worker's call is to be settled.
    stopped, stopped_row, stopped_read = claim(task, "stopped")
    if stopped_read is not None:
        assert engine._reads(stopped_row, stopped_read)[3], "the stopped worker's reads see the lost call"
    lose_the_lease(task)
    # A third takes the task over, settles the lost call as unknown, and sends a call of its own.
    new, new_row, new_read = claim(task, "new")
    assert new.epoch > stopped.epoch > lost.epoch
    run = engine._load(new, new_row, new_read)
    assert run is not None
    assert LedgerEntry.objects.get(id=lost_call.id).status == "unknown"
    new_call = in_flight(new, task, 2)
    # The stopped worker runs again, and loads what it claimed: its lease is gone.
    with pytest.raises(leases.LeaseLost):
        engine._load(stopped, stopped_row, stopped_read)
    # The new owner's call is still in flight, as it is: not unknown for a reconcile or a person.
    entry = LedgerEntry.objects.get(id=new_call.id)
    assert (entry.status, entry.lease_epoch) == ("started", new.epoch)
    # And nothing else of the stopped worker's landed: the task is the new owner's, as it left it.
    row = Task.objects.get(id=task.id)
    assert (row.status, row.lease_owner, row.lease_epoch) == ("working", "new", new.epoch)
    assert LedgerEntry.objects.get(id=lost_call.id).status == "unknown"


def test_a_worker_stopped_after_claiming_a_working_task_writes_nothing_once_run_again(alice):
    """The stopped worker claimed a task still working (its holder gave the lease back after an
    infrastructure fault, its call's row left started), so its load has no start to write and
    no fence to fail there: it settles (nothing of the new owner's) and goes on to run a step,
    whose commit the fence refuses."""
    task = new_task(alice, steps=10)
    lost, *_ = claim(task, "lost")
    assert engine._load(lost) is not None
    lost_call = in_flight(lost, task, 1)
    # Given back as engine._abandon does (Task.drop_lease(fence=False)): still working, claimable.
    Task.objects.filter(id=task.id).update(lease_owner=None, lease_expires_at=None)
    stopped, stopped_row, stopped_read = claim(task, "stopped")
    assert stopped_row.status == "working"
    lose_the_lease(task)
    new, new_row, new_read = claim(task, "new")
    assert engine._load(new, new_row, new_read) is not None
    new_call = in_flight(new, task, 2)
    before = Task.objects.get(id=task.id)
    steps = Step.objects.filter(task=task).count()
    # Running again: the load (nothing of the new owner's settled), then the slice's loop.
    run = engine._load(stopped, stopped_row, stopped_read)
    assert run is not None
    assert LedgerEntry.objects.get(id=new_call.id).status == "started"
    heartbeat = leases.Heartbeat(stopped, ttl=30, interval=3600, abandon=operators.do_abandon_step)
    with heartbeat, pytest.raises(leases.LeaseLost):
        engine._loop(run, heartbeat)
    # Nothing of it landed: no step, the row as the new owner left it, the calls as they were.
    after = Task.objects.get(id=task.id)
    assert Step.objects.filter(task=task).count() == steps
    assert (after.lease_owner, after.lease_epoch, after.state_version, after.steps_done) == (
        "new",
        new.epoch,
        before.state_version,
        before.steps_done,
    )
    assert LedgerEntry.objects.get(id=new_call.id).status == "started"
    assert LedgerEntry.objects.get(id=lost_call.id).status == "unknown"
