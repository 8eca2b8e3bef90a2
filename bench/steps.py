"""Engine overhead: a no-op agent for N steps vs a bare Celery successor-enqueue chain.

    .venv/bin/python bench/steps.py --steps 1000 --repeat 3

Both run on the same real worker process (prefork, -c 1) against PostgreSQL and Redis,
in the same run. Reported: ms per step and steps per second for the runtime (with one
step per slice, i.e. a broker hop per step like the baseline, and with the default
slices), the baseline's ms per hop, and the ratios. A bench database is created fresh.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import _common


def baseline(n: int) -> float:
    """Seconds for n successor hops."""
    import redis

    from bench.baseline_tasks import successor

    r = redis.Redis.from_url(os.environ["REDIS_URL"])
    run_id = uuid.uuid4().hex
    start = time.time()
    successor.apply_async(args=[run_id, n - 1])
    _common.wait(lambda: r.exists(f"bench:{run_id}:done"))
    return float(r.get(f"bench:{run_id}:done")) - start


def runtime(n: int, tenant) -> float:
    """Seconds from task creation to completion for an n-step no-op task."""
    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.models import Task

    start = time.time()
    task, _ = do_create_task(
        console(tenant, "user:bench"), agent="noop", input={"steps": n}, checkpoint_policy={"everySteps": 10}
    )
    _common.wait(lambda: Task.objects.filter(id=task.id, status="completed").exists())
    task.refresh_from_db()
    assert task.steps_done == n, task.steps_done
    return task.finished_at.timestamp() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    _common.setup()
    from tasks_app.models import Tenant

    tenant = Tenant.objects.create(slug="bench", name="bench")
    rows = []
    for label, slice_steps in (("runtime, 1 step per slice", "1"), ("runtime, default slices", None)):
        env = {"RUNTIME_SLICE_STEPS": slice_steps} if slice_steps else {}
        worker = _common.worker(None, "-I", "bench.baseline_tasks", **env)
        try:
            baseline(50), runtime(20, tenant)  # warm-up: imports, connections
            base = statistics.median(baseline(args.steps) for _ in range(args.repeat))
            ours = statistics.median(runtime(args.steps, tenant) for _ in range(args.repeat))
        finally:
            worker.terminate()
            worker.wait()
        rows.append((label, base, ours))

    n = args.steps
    print(f"N = {n} steps, median of {args.repeat}; one worker process (-c 1); PostgreSQL + Redis on loopback")
    print(f"{'configuration':32} {'ms/step':>9} {'steps/s':>9} {'baseline ms/hop':>16} {'ratio':>7}")
    for label, base, ours in rows:
        print(f"{label:32} {ours / n * 1000:9.2f} {n / ours:9.0f} {base / n * 1000:16.2f} {ours / base:7.2f}")
    print("ratio = runtime time / bare Celery successor-enqueue time for the same N, same run")


if __name__ == "__main__":
    main()
