"""Throughput by worker processes: 200 short tasks on 1, 2 and 4 pool processes, and what
saturates first (database, broker, CPU).

    .venv/bin/python bench/scale.py --tasks 200 --steps 10 --processes 1 2 4

For each pool size, one Celery worker (-c N) runs `--tasks` no-op tasks of `--steps` steps
(default slices and checkpoint policy), created at once through do_create_task once the
worker is warm. Measured from the first create to the last task's finished_at: tasks/s
and steps/s. Sampled every 0.2 s meanwhile, from /proc and the servers themselves: the
machine's CPU busy share (of all cores), the CPU used by the worker's processes, by
PostgreSQL backends (all of the server's: the machine is shared) and by redis-server, as
cores; the database sessions of the bench database that are active, and of those how many
wait on a lock or on I/O (pg_stat_activity); Redis's ops/s. Read it as: the resource whose
use stops growing while throughput stops growing is the one that saturated; the machine's
CPU at ~100 % means CPU (one machine: the database, broker and workers share its cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import _common

TICK = os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores so far."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def cpu_by_pid() -> dict[str, dict[int, float]]:
    """CPU seconds so far of every postgres and redis-server process, by name and pid (by
    pid: a backend that exits takes its CPU time with it, so only deltas per pid add up)."""
    out: dict[str, dict[int, float]] = {"postgres": {}, "redis-server": {}}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if comm in out:
                f = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
                out[comm][int(pid)] = (int(f[11]) + int(f[12])) / TICK
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def used(now: dict[int, float], before: dict[int, float]) -> float:
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in now.items())


class Sampler(threading.Thread):
    def __init__(self, worker_pid: int) -> None:
        super().__init__(daemon=True)
        self.worker_pid, self.stop, self.samples = worker_pid, threading.Event(), []

    def run(self) -> None:
        import psycopg
        import redis
        from slices import worker_cpu

        r = redis.Redis.from_url(os.environ["REDIS_URL"])
        db = os.environ["DATABASE_URL"]
        with psycopg.connect(db, autocommit=True) as conn:
            prev = (time.monotonic(), machine_busy(), worker_cpu(self.worker_pid), cpu_by_pid())
            while not self.stop.wait(0.2):
                now = (time.monotonic(), machine_busy(), worker_cpu(self.worker_pid), cpu_by_pid())
                dt = now[0] - prev[0]
                active, waiting = conn.execute(
                    "SELECT count(*) FILTER (WHERE state = 'active'), count(*) FILTER (WHERE state = 'active' "
                    "AND wait_event_type IN ('Lock', 'LWLock', 'IO')) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).fetchone()
                self.samples.append(
                    {
                        "machine %": 100 * (now[1][0] - prev[1][0]) / max(now[1][1] - prev[1][1], 1),
                        "worker cores": (now[2] - prev[2]) / dt,
                        "postgres cores": used(now[3]["postgres"], prev[3]["postgres"]) / dt,
                        "redis cores": used(now[3]["redis-server"], prev[3]["redis-server"]) / dt,
                        "db active": active,
                        "db waiting": waiting,
                        "redis ops/s": r.info("stats")["instantaneous_ops_per_sec"],
                    }
                )
                prev = now


def run(processes: int, tasks: int, steps: int, tenant: object) -> dict[str, float]:
    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.models import Task

    worker = _common.worker(None, "-c", str(processes))
    try:
        warm, _ = do_create_task(console(tenant, "user:bench"), agent="noop", input={"steps": 2})
        _common.wait(lambda: Task.objects.filter(id=warm.id, status="completed").exists(), 120)
        sampler = Sampler(worker.pid)
        sampler.start()
        start = time.time()
        ids = [
            do_create_task(console(tenant, "user:bench"), agent="noop", input={"steps": steps})[0].id
            for _ in range(tasks)
        ]
        created = time.time() - start
        _common.wait(lambda: Task.objects.filter(id__in=ids, status="completed").count() == tasks, 1200, 0.2)
        sampler.stop.set()
        sampler.join()
        last = max(Task.objects.filter(id__in=ids).values_list("finished_at", flat=True)).timestamp()
    finally:
        worker.terminate()
        worker.wait()
    seconds = last - start
    out = {"seconds": seconds, "create s": created, "tasks/s": tasks / seconds, "steps/s": tasks * steps / seconds}
    for key in sampler.samples[0]:
        out[key] = statistics.mean(s[key] for s in sampler.samples)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    _common.setup()
    from tasks_app.models import Tenant

    tenant = Tenant.objects.create(slug="bench", name="bench")
    rows = {n: run(n, args.tasks, args.steps, tenant) for n in args.processes}
    print(
        f"{args.tasks} no-op tasks of {args.steps} steps, created at once; one worker with -c N; {os.cpu_count()} cores "
        f"shared by the worker, PostgreSQL, Redis and this bench (and whatever else runs on the machine)"
    )
    keys = list(next(iter(rows.values())))
    print(f"{'measure':16}" + "".join(f"{f'-c {n}':>10}" for n in rows))
    for key in keys:
        print(f"{key:16}" + "".join(f"{rows[n][key]:10.2f}" for n in rows))
    print("means over the run's 0.2 s samples; cores = CPU seconds per second")


if __name__ == "__main__":
    main()
