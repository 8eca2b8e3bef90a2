"""Slice start: what one slice (claim, load, first step, yield, hand on) costs beside a bare
Celery successor hop that makes one PostgreSQL transaction, in the same run.

    .venv/bin/python bench/slices.py --slices 300 --rounds 3 [--baseline main]

One real worker process (prefork, -c 1) with RUNTIME_SLICE_STEPS=1, so a no-op task of N
steps runs N slices, each a broker hop: claim the lease, load the task, its newest
checkpoint, steering answers and agent, run one step, commit it, yield (checkpoint and
release), enqueue the successor. The baseline on the same worker: a Celery task that
updates a row and inserts one in one transaction, then enqueues itself, N times.
Interleaved rounds; with --baseline a git ref's runtime runs the same workload on a
worker of its own code (exported with git archive). Reported per build: the median wall
ms per slice and the worker's CPU ms per slice (all its processes, from /proc; steadier
than wall time on a shared machine), and both as ratios to the hop. Target: <= 3 x the hop.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import uuid
from pathlib import Path

import _common


def worker_cpu(pid: int) -> float:
    """CPU seconds of a worker: its main process and every descendant (the pool)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            for tid in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
        except FileNotFoundError:
            continue
    return total


def hops(n: int, pid: int) -> tuple[float, float]:
    """(wall seconds, worker CPU seconds) for n successor hops, one transaction each."""
    import redis
    from django.db import connection

    from bench.baseline_tasks import successor_pg

    r = redis.Redis.from_url(os.environ["REDIS_URL"])
    run_id = uuid.uuid4().hex
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO bench_hop_run (id, done) VALUES (%s, 0)", [run_id])
    cpu, start = worker_cpu(pid), time.time()
    successor_pg.apply_async(args=[run_id, n - 1])
    _common.wait(lambda: r.exists(f"bench:{run_id}:done"), interval=0.005)
    wall = float(r.get(f"bench:{run_id}:done")) - start
    time.sleep(0.2)  # the last hop's ack
    return wall, worker_cpu(pid) - cpu


def slices(n: int, tenant: object, pid: int) -> tuple[float, float]:
    """(wall seconds, worker CPU seconds) from creation to completion of an n-step no-op task,
    one step per slice."""
    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.models import Task

    cpu, start = worker_cpu(pid), time.time()
    task, _ = do_create_task(console(tenant, "user:bench"), agent="noop", input={"steps": n})
    _common.wait(lambda: Task.objects.filter(id=task.id, status="completed").exists(), interval=0.005)
    task.refresh_from_db()
    assert task.steps_done == n, task.steps_done
    assert task.steps.count() == n
    time.sleep(0.2)
    return task.finished_at.timestamp() - start, worker_cpu(pid) - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slices", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a git ref whose runtime to measure beside this checkout, e.g. main")
    args = parser.parse_args()
    _common.setup()
    from django.db import connection

    from tasks_app.models import Tenant

    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE bench_hop_run (id text PRIMARY KEY, done int NOT NULL)")
        cursor.execute("CREATE TABLE bench_hop_step (run text, seq int, at timestamptz DEFAULT now())")
    tenant = Tenant.objects.create(slug="bench", name="bench")
    builds = {"runtime": _common.ROOT}
    if args.baseline:
        from _common import export

        builds = {f"runtime@{args.baseline}": export(args.baseline), **builds}
    results: dict[str, list[tuple[float, float]]] = {"hop": [], **{b: [] for b in builds}}
    n = args.slices
    try:
        for _ in range(args.rounds):
            for build, folder in builds.items():
                mine = folder == _common.ROOT
                extra = ("-I", "bench.baseline_tasks") if mine else ()
                worker = _common.worker(None, *extra, cwd=folder, RUNTIME_SLICE_STEPS="1")
                try:
                    slices(10, tenant, worker.pid)  # warm-up: imports, connections
                    if mine:
                        hops(20, worker.pid)
                        results["hop"].append(hops(n, worker.pid))
                    results[build].append(slices(n, tenant, worker.pid))
                finally:
                    worker.terminate()
                    worker.wait()
    finally:
        for folder in builds.values():
            if folder != _common.ROOT:
                shutil.rmtree(folder, ignore_errors=True)

    def ms(values: list[tuple[float, float]], i: int) -> float:
        return statistics.median(v[i] for v in values) / n * 1000

    hop_wall, hop_cpu = ms(results["hop"], 0), ms(results["hop"], 1)
    print(f"N = {n} slices (one step each), median of {args.rounds} interleaved rounds; one worker (-c 1)")
    print(f"{'build':24} {'wall ms':>8} {'rounds (wall ms)':>24} {'cpu ms':>7} {'wall/hop':>9} {'cpu/hop':>8}")
    for name, values in results.items():
        rounds = " ".join(f"{v[0] / n * 1000:.2f}" for v in values)
        wall, cpu = ms(values, 0), ms(values, 1)
        print(f"{name:24} {wall:8.2f} {rounds:>24} {cpu:7.2f} {wall / hop_wall:9.2f} {cpu / hop_cpu:8.2f}")
    print("hop: a bare Celery successor hop with one PG transaction; target: a slice <= 3 x a hop")


if __name__ == "__main__":
    main()
