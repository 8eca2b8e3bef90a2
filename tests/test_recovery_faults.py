"""Issue 12 with real worker processes: a worker killed twice inside the same steps before
a checkpoint, and (below) infrastructure faults and cancels that must not lose a task."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import FAST_LEASES, Processes, wait_until
from tasks_app.actions import do_create_task
from tasks_app.audit import verify_chain
from tasks_app.models import Step, Task
from tasks_app.selectors import task_snapshot

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
    task, _ = do_create_task(alice.tenant, actor="user:test", agent="noop", input={"steps": 24, "sleepMs": 500},
                             checkpoint_policy={"everySteps": 10})
    watch = Watcher(task)
    wait_until(lambda: watch.now()["stepsDone"] >= 14, timeout=60, what="14 steps (checkpoint at 10)")
    processes.kill(worker)  # SIGKILL mid-step: 11..14 were committed after the checkpoint
    high = Task.objects.get(id=task.id).steps_done

    worker = processes.worker(**FAST)  # resumes from checkpoint 10 and re-runs 11, 12 ...
    wait_until(lambda: watch.now() and Step.objects.filter(task=task, sequence=12, attempt=2).exists(),
               timeout=60, interval=0.05, what="the re-run to reach step 12")
    processes.kill(worker)  # ... and dies again inside the same range
    assert not Step.objects.filter(task=task, sequence=high, attempt=2).exists(), "the second kill came too late"

    processes.worker(**FAST)
    wait_until(lambda: watch.now()["runtimeStatus"] in ("completed", "failed", "dead_lettered"), timeout=120,
               what="the task to end")
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
