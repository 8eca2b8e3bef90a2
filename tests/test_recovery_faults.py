"""Issue 12 with real worker processes: a worker killed twice inside the same steps before
a checkpoint, and (below) infrastructure faults and cancels that must not lose a task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from conftest import FAST_LEASES, Processes, database_url, settled, wait_until
from ledger_app.models import LedgerEntry
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Step, Task
from tasks_app.selectors import task_snapshot
from tests.test_ledger import Sink, webhook
from tests.test_steering_live import live  # noqa: F401 (a fixture: web, two workers and beat)

pytestmark = pytest.mark.django_db(transaction=True)

# No slice ends inside the test's range of steps: the only checkpoints are the policy's.
FAST = {**FAST_LEASES, "RUNTIME_SLICE_STEPS": "1000", "RUNTIME_SLICE_SECONDS": "600"}


class Watcher:
    """Reads the task's snapshot (the one REST, MCP and the stream show) at every poll."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.seen: list[dict[str, Any]] = []

    def now(self) -> dict[str, Any]:
        snapshot = task_snapshot(Task.objects.get(id=self.task.id))
        self.seen.append(snapshot)
        return snapshot

    def assert_never_went_back(self) -> None:
        for key in ("stepsDone", "progress"):
            values = [s[key] for s in self.seen]
            assert values == sorted(values), f"{key} went back: {values}"


def test_a_worker_killed_twice_inside_the_same_steps_before_a_checkpoint_completes(alice, processes: Processes):
    processes.beat(**FAST)
    worker = processes.worker(**FAST)
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="noop",
        input={"steps": 24, "sleepMs": 500},
        checkpoint_policy={"everySteps": 10},
    )
    watch = Watcher(task)
    wait_until(lambda: watch.now()["stepsDone"] >= 14, timeout=60, what="14 steps (checkpoint at 10)")
    processes.kill(worker)  # SIGKILL mid-step: 11..14 were committed after the checkpoint
    high = Task.objects.get(id=task.id).steps_done

    worker = processes.worker(**FAST)  # resumes from checkpoint 10 and re-runs 11, 12 ...
    wait_until(
        lambda: watch.now() and Step.objects.filter(task=task, sequence=12, attempt=2).exists(),
        timeout=60,
        interval=0.05,
        what="the re-run to reach step 12",
    )
    processes.kill(worker)  # ... and dies again inside the same range
    assert not Step.objects.filter(task=task, sequence=high, attempt=2).exists(), "the second kill came too late"

    processes.worker(**FAST)
    wait_until(
        lambda: watch.now()["runtimeStatus"] in ("completed", "failed", "dead_lettered"),
        timeout=120,
        what="the task to end",
    )
    task.refresh_from_db()
    assert task.status == "completed", task.error
    assert task.result == {"steps": 24} and task.recoveries == 2
    rows = list(Step.objects.filter(task=task).values_list("sequence", "attempt"))
    per_sequence: dict[int, list[int]] = {}
    for sequence, attempt in sorted(rows):
        per_sequence.setdefault(sequence, []).append(attempt)
    assert sorted(per_sequence) == list(range(1, 25))
    assert all(a == list(range(1, len(a) + 1)) for a in per_sequence.values()), per_sequence  # 1, 2, 3 in turn
    assert all(len(per_sequence[s]) == 1 for s in range(1, 11))  # the checkpoint was never re-run
    assert per_sequence[11] == [1, 2, 3]  # run after each kill
    watch.assert_never_went_back()
    assert verify_chain(task) is None


def test_a_task_that_loses_more_workers_than_max_recoveries_each_time_further_on_completes(alice, processes: Processes):
    """Four workers SIGKILLed at far-apart steps, one more than runtime.max_recoveries: each
    next worker gets beyond the furthest step committed before, so each recovery made
    progress and the task is delayed, not dead-lettered (it was, before the count was of
    recoveries in a row without progress)."""
    env = {**FAST, "RUNTIME_MAX_RECOVERIES": "3"}
    processes.beat(**env)
    worker = processes.worker(**env)
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="noop",
        input={"steps": 40, "sleepMs": 200},
        checkpoint_policy={"everySteps": 5},
    )
    watch = Watcher(task)
    for reached in (7, 15, 23, 31):
        wait_until(lambda n=reached: watch.now()["stepsDone"] >= n, timeout=90, what=f"{reached} steps")
        processes.kill(worker)  # SIGKILL mid-step, its lease held
        worker = processes.worker(**env)
    wait_until(
        lambda: watch.now()["runtimeStatus"] in ("completed", "failed", "dead_lettered"),
        timeout=120,
        what="the task to end",
    )
    snapshot = watch.now()
    assert snapshot["runtimeStatus"] == "completed", snapshot["error"]
    assert (snapshot["recoveries"], snapshot["recoveriesInARow"]) == (4, 1)
    recovered = AuditRecord.objects.filter(task=task, to_status="recovering").order_by("seq")
    assert [r.data["inARow"] for r in recovered] == [1, 1, 1, 1]
    watch.assert_never_went_back()
    assert verify_chain(Task.objects.get(id=task.id)) is None


def terminate_backends(application_name: str) -> int:
    """pg_terminate_backend on the connections of one process kind, in this test's database only."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            [application_name],
        )
        return cursor.fetchone()[0]


def past(task: Task, steps: int) -> bool:
    """The task has done this many steps, or stopped for good trying."""
    row = Task.objects.get(id=task.id)
    return row.steps_done >= steps or row.is_terminal


def test_database_connections_cut_mid_call_delay_the_task_and_never_fail_it(alice, processes: Processes):
    # A slow remote: each step's POST takes 0.6 s, so a cut lands while the call is in flight
    # and the step's next database write (settling the ledger row) meets a dead connection.
    sink = Sink(processes, delay_ms=600)
    env = {**FAST_LEASES, "RUNTIME_SLICE_STEPS": "4", "SECURITY_HTTP_ALLOWLIST": "127.0.0.1"}
    worker = processes.worker(**env, DATABASE_URL=f"{database_url()}?application_name=rt-fault-worker")
    processes.beat(**env)
    task = webhook(alice, sink, count=10)
    for at in (2, 5, 8):
        wait_until(lambda at=at: past(task, at), timeout=60, what=f"{at} steps")
        assert not Task.objects.get(id=task.id).is_terminal, Task.objects.get(id=task.id).error  # not by the cut
        # (Between slices, and backing off after a fault, the worker holds no connection.)
        wait_until(
            lambda: terminate_backends("rt-fault-worker"), timeout=30, interval=0.05, what="a worker connection to cut"
        )

    task = settled(task)
    assert task.status == "completed", task.error
    assert task.result["sent"] == 10
    # A cut that meets the answer's write is absorbed (written again on a fresh connection:
    # ledger_app.actions._settle); one that meets another write abandons the slice, an
    # infrastructure fault counted as such and resumed at once. Never counted as a crash.
    absorbed = Path(worker.log_path).read_text(errors="replace").count("its answer could not be written")  # type: ignore[attr-defined]
    assert task.infra_faults + absorbed >= 1 and task.recoveries == 0, (task.infra_faults, absorbed)
    assert AuditRecord.objects.filter(task=task, action="infrastructure_fault").count() == task.infra_faults
    stats = sink.stats()
    assert stats["effects"] == 10 and set(stats["perKey"].values()) == {1}  # each call made once
    assert set(LedgerEntry.objects.filter(task=task).values_list("status", flat=True)) == {"succeeded"}
    assert verify_chain(task) is None


@pytest.mark.parametrize("how", ["steering", "rest"])
def test_a_cancel_right_after_a_pause_during_a_long_step_cancels_the_task(live, how):  # noqa: F811
    api, _ = live
    task_id = api.create("noop", {"steps": 6, "sleepMs": 2000})
    wait_until(lambda: Step.objects.filter(task_id=task_id).exists(), timeout=30, what="the first step")
    assert api.steer(task_id, "pause").json()["status"] == "pending"  # a 2 s step is under way
    if how == "steering":
        assert api.steer(task_id, "cancel", reason="stop it").json()["status"] == "pending"
    else:
        response = api.http.post(f"/runtime/tasks/{task_id}/cancel", json={"reason": "stop it"})
        assert response.status_code == 202 and response.json()["cancelRequested"] is True
    # The worker applies both at its safe point; the pause must not swallow the cancel.
    wait_until(
        lambda: api.snapshot(task_id)["runtimeStatus"] in ("cancelled", "paused"),
        timeout=30,
        what="the commands to land",
    )
    snapshot = api.snapshot(task_id)
    assert (snapshot["status"], snapshot["runtimeStatus"]) == ("cancelled", "cancelled")
    task = Task.objects.get(id=task_id)
    assert task.cancel_reason == "stop it" and task.lease_owner is None and task.steps_done < 6
    history = api.http.get(f"/runtime/tasks/{task_id}/steering").json()["results"]
    assert all(c["status"] == "applied" for c in history)
    assert verify_chain(task) is None


def test_a_database_connection_cut_while_a_call_is_out_leaves_nothing_for_a_person_to_confirm(
    alice, processes: Processes
):
    """The worker's connections cut while each call is out, between its ledger row's
    "started" and the answer's write: the answer met the dead connection, the slice was
    abandoned, and its row, found started by the next slice, was unknown: with a remote that
    cannot be asked, a person had to confirm a call whose answer the worker had in hand. The
    answer is written on a fresh connection (fenced, for as long as the lease), so the task
    goes on: each call made once, as the receiver counts, and no question for anyone."""
    sink = Sink(processes, delay_ms=1000)  # each call is out for a second: the cut lands in it
    env = {**FAST_LEASES, "SECURITY_HTTP_ALLOWLIST": "127.0.0.1"}
    processes.worker(**env, DATABASE_URL=f"{database_url()}?application_name=rt-fault-worker")
    processes.beat(**env)
    task = webhook(alice, sink, count=3, reconcile=False)  # no reconcile hook: only a person could tell

    def out(sequence: int) -> LedgerEntry | bool:
        """The call's row while it is out; or True once the task has stopped (asserted below)."""
        return LedgerEntry.objects.filter(task=task, step_sequence=sequence, status="started").first() or (
            Task.objects.get(id=task.id).status in ("completed", "failed", "input_required")
        )

    for sequence in (1, 2, 3):
        entry = wait_until(lambda s=sequence: out(s), timeout=60, interval=0.05, what=f"call {sequence} out")
        if not isinstance(entry, LedgerEntry):
            break
        assert terminate_backends("rt-fault-worker") >= 1
        # Still started after the cut: the answer had not been written; its write met the cut.
        assert LedgerEntry.objects.get(id=entry.id).status == "started", "the cut came after the answer's write"

    task = settled(task)
    assert task.status == "completed", (task.status, task.error)
    assert task.result["sent"] == 3 and task.recoveries == 0
    assert not task_snapshot(task)["inputRequests"]
    stats = sink.stats()
    assert stats["effects"] == 3 and set(stats["perKey"].values()) == {1}, stats  # each call made once
    statuses = LedgerEntry.objects.filter(task=task).order_by("step_sequence").values_list("status", flat=True)
    assert list(statuses) == ["succeeded"] * 3
    assert verify_chain(task) is None
