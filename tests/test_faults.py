"""Fault injection with real processes: a worker frozen past its lease (SIGSTOP/SIGCONT),
a Redis restart mid-run, and PostgreSQL connections terminated mid-slice."""

from __future__ import annotations

import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from django.db import connection

from checkpoints_app.models import Checkpoint
from conftest import FAST_LEASES, Processes, free_port, wait_until
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.audit import verify_chain
from tasks_app.models import Step, Task

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_LEASES, "RUNTIME_STALL_SECONDS": "3", "RUNTIME_SLICE_STEPS": "8"}


def steps_by_sequence(task: Task) -> Counter[int]:
    return Counter(Step.objects.filter(task=task).values_list("sequence", flat=True))


def assert_ran_once_up_to_checkpoints(task: Task, steps: int) -> None:
    """Every step committed; a step ran twice only if a crash came before its checkpoint,
    and then as a visible second attempt."""
    counts = steps_by_sequence(task)
    assert sorted(counts) == list(range(1, steps + 1))
    assert all(n <= 2 for n in counts.values()), counts
    for seq, n in counts.items():
        if n == 2:
            assert Step.objects.filter(task=task, sequence=seq, attempt=2).exists()


def test_a_frozen_worker_resumed_after_a_takeover_commits_nothing(alice, processes: Processes):
    frozen = processes.worker(**FAST)
    processes.beat(**FAST)
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="noop",
        input={"steps": 40, "sleepMs": 100},
        checkpoint_policy={"everySteps": 4},
    )
    wait_until(lambda: Task.objects.get(id=task.id).steps_done >= 6, timeout=30, what="6 steps")
    processes.kill(frozen, signal.SIGSTOP)  # mid-step: its lease runs out while it cannot move
    at_freeze = Task.objects.get(id=task.id)
    zombie = at_freeze.lease_owner
    assert zombie is not None

    processes.worker(**FAST)
    wait_until(
        lambda: Step.objects.filter(task=task).exclude(worker=zombie).exists(),
        timeout=30,
        what="another worker to take the task over",
    )
    processes.kill(frozen, signal.SIGCONT)  # the zombie wakes up, finishes its step, tries to commit
    wait_until(
        lambda: "lease lost, slice abandoned" in Path(frozen.log_path).read_text(),
        timeout=30,
        what="the zombie to hit the fence",
    )
    wait_until(lambda: Task.objects.get(id=task.id).status == "completed", timeout=60, what="completion")

    task.refresh_from_db()
    assert task.result == {"steps": 40} and task.recoveries == 1
    # Under the lease it held when frozen, the zombie committed nothing after the freeze
    # (once awake it is an ordinary worker again and may claim later slices afresh).
    frozen_lease = Step.objects.filter(task=task, lease_epoch=at_freeze.lease_epoch)
    assert set(frozen_lease.values_list("worker", flat=True)) == {zombie}
    assert max(frozen_lease.values_list("sequence", flat=True)) == at_freeze.steps_done
    assert_ran_once_up_to_checkpoints(task, 40)
    assert verify_chain(task) is None


def test_a_redis_restart_mid_run_loses_no_task(alice, processes: Processes, private_redis):
    port, start_redis = private_redis
    redis_proc = start_redis()
    env = {**FAST, "REDIS_URL": f"redis://127.0.0.1:{port}/0"}
    web_port = free_port()
    processes.web(web_port, **env)
    processes.worker(concurrency=2, **env)
    processes.beat(**env)
    api = httpx.Client(
        base_url=f"http://127.0.0.1:{web_port}", headers={"Authorization": f"Bearer {alice.token}"}, timeout=10
    )

    def submit() -> str:
        response = api.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 30, "sleepMs": 60}})
        assert response.status_code == 201, response.text
        return response.json()["taskId"]

    ids = [submit() for _ in range(4)]
    wait_until(
        lambda: Task.objects.filter(id__in=ids, steps_done__gt=0).count() >= 2, timeout=30, what="work to be under way"
    )
    processes.kill(redis_proc)  # every queued and in-flight message is gone with it
    ids.append(submit())  # the API keeps accepting work while the broker is down
    time.sleep(2)  # an outage, not a blip: its length is the fault being injected, not a wait
    start_redis()  # empty: nothing in it survived

    wait_until(
        lambda: Task.objects.filter(id__in=ids, status="completed").count() == len(ids),
        timeout=120,
        what="every task to complete after the Redis restart",
    )
    for task in Task.objects.filter(id__in=ids):
        assert task.result == {"steps": 30}
        counts = steps_by_sequence(task)
        assert sorted(counts) == list(range(1, 31)) and set(counts.values()) == {1}  # no step ran twice


def test_terminated_database_connections_mid_slice_are_survived(alice, processes: Processes):
    processes.worker(**FAST)
    processes.beat(**FAST)
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="noop",
        input={"steps": 40, "sleepMs": 80},
        checkpoint_policy={"everySteps": 4},
    )
    wait_until(lambda: Task.objects.get(id=task.id).steps_done >= 5, timeout=30, what="5 steps")
    with connection.cursor() as cursor:  # every backend of the test database but ours: the worker's
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        assert cursor.fetchone()[0] >= 1
    wait_until(
        lambda: Task.objects.get(id=task.id).status == "completed",
        timeout=90,
        what="completion after the connections were cut",
    )
    task.refresh_from_db()
    assert task.result == {"steps": 40}
    assert_ran_once_up_to_checkpoints(task, 40)
    latest = Checkpoint.objects.filter(task=task).order_by("-sequence").first()
    assert latest is not None and latest.sequence == 40
    assert verify_chain(task) is None


def test_writes_answer_while_redis_is_frozen(alice, processes: Processes, private_redis):
    """Redis only rings doorbells (DESIGN §1). Frozen (SIGSTOP: a hung server, a partition
    that drops packets), it held every create's after-commit publishes for as long as it was
    frozen, each with the request's pooled database connection: once the pool was used up,
    reads that need no Redis were 503s too (adv3: 25 creates, then a list, 503 after 5 s).
    Each now waits on Redis for seconds at most (RUNTIME_REDIS_PUBLISH_SECONDS a try)."""
    port, start_redis = private_redis
    redis_proc = start_redis()
    web_port = free_port()
    processes.web(web_port, REDIS_URL=f"redis://127.0.0.1:{port}/0")
    api = httpx.Client(
        base_url=f"http://127.0.0.1:{web_port}", headers={"Authorization": f"Bearer {alice.token}"}, timeout=30
    )
    assert api.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 1}}).status_code == 201
    processes.kill(redis_proc, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=6) as pool:
            creates = [
                pool.submit(api.post, "/runtime/tasks", json={"agent": "noop", "input": {"steps": 1}}) for _ in range(6)
            ]
            answers = [future.result() for future in creates]  # ReadTimeout (30 s) while they waited on Redis
        took = time.monotonic() - started
        listed = api.get("/runtime/tasks?limit=10")
    finally:
        processes.kill(redis_proc, signal.SIGCONT)
    assert [a.status_code for a in answers] == [201] * 6, [a.text[:200] for a in answers]
    assert took < 15, took
    assert listed.status_code == 200 and {a.json()["taskId"] for a in answers} <= {
        t["taskId"] for t in listed.json()["results"]
    }
