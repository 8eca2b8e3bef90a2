"""Chaos: K document reviews under two workers while a worker is SIGKILLed at random.

    .venv/bin/python bench/chaos.py --tasks 8 --docs 300 --batch 3 --kill-every 2:5

Two worker processes (prefork, -c 1) and one beat run against PostgreSQL and Redis (a
fresh bench database). Every few seconds a random worker's process group is killed
with SIGKILL and a fresh worker is started in its place, until every task has ended.
Printed: tasks lost (not completed; must be 0), steps committed twice (with a
checkpoint at every step, only an in-flight step, which never committed, may run
again: must be 0), dead letters, and the kill → new-lease takeover times (from the kill
to the audited `recovering → working` of each task the killed worker held).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import _common

SETTINGS = {
    "RUNTIME_LEASE_SECONDS": "3",
    "RUNTIME_HEARTBEAT_SECONDS": "1",
    "RUNTIME_SCAN_SECONDS": "1",
    "RUNTIME_STALL_SECONDS": "10",
    "RUNTIME_SLICE_STEPS": "20",
}


def held_by(proc, owners: dict[str, str]) -> list[str]:
    """Task ids whose lease owner (host:pid of a pool child) is in proc's process group."""
    held = []
    for task_id, owner in owners.items():
        pid = int(owner.rsplit(":", 1)[1])
        try:
            if os.getpgid(pid) == proc.pid:
                held.append(task_id)
        except ProcessLookupError:
            pass
    return held


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--every-steps", type=int, default=1, help="checkpoint policy of the tasks")
    parser.add_argument("--kill-every", default="2:5", help="seconds between kills, min:max")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-recoveries", default="3", help="runtime.max_recoveries for this run")
    args = parser.parse_args()
    low, high = (float(x) for x in args.kill_every.split(":"))
    rng = random.Random(args.seed)
    SETTINGS["RUNTIME_MAX_RECOVERIES"] = args.max_recoveries
    for key, value in SETTINGS.items():
        os.environ.setdefault(key, value)
    _common.setup()

    from runtime_site.blobstore import blob_store
    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.agents.document_review.corpus import generate_corpus
    from tasks_app.models import AuditRecord, Step, Task, Tenant

    generate_corpus(blob_store(), "corpora/chaos", args.docs, 42, "2026-11-01")
    tenant = Tenant.objects.create(slug="chaos", name="chaos")
    logs = Path(tempfile.mkdtemp(prefix="chaos-"))
    beat = _common.start(
        ["celery", "-A", "runtime_site", "beat", "-l", "WARNING", "-s", str(logs / "beat")], logs / "beat.log"
    )
    workers = [_common.worker(logs / f"worker-{i}.log") for i in range(2)]
    ids = [
        str(
            do_create_task(
                console(tenant, "user:chaos"),
                agent="document_review",
                input={"corpus": "corpora/chaos", "batchSize": args.batch},
                checkpoint_policy={"everySteps": args.every_steps},
            )[0].id
        )
        for _ in range(args.tasks)
    ]
    kills: list[tuple[datetime, list[str]]] = []
    started = time.monotonic()
    next_kill = started + rng.uniform(low, high)
    try:
        while Task.objects.filter(
            id__in=ids, status__in=["completed", "failed", "cancelled", "dead_lettered"]
        ).count() < len(ids):
            if time.monotonic() - started > args.timeout:
                print("TIMEOUT")
                break
            if time.monotonic() >= next_kill:
                victim = rng.randrange(len(workers))
                owners = dict(
                    Task.objects.filter(id__in=ids, lease_owner__isnull=False).values_list("id", "lease_owner")
                )
                held = held_by(workers[victim], {str(k): v for k, v in owners.items()})
                os.killpg(workers[victim].pid, signal.SIGKILL)
                workers[victim].wait()
                kills.append((datetime.now(UTC), held))
                workers[victim] = _common.worker(logs / f"worker-r{len(kills)}.log")
                next_kill = time.monotonic() + rng.uniform(low, high)
            time.sleep(0.2)
        elapsed = time.monotonic() - started
    finally:
        for proc in [*workers, beat]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    tasks = list(Task.objects.filter(id__in=ids))
    # Dead letters are held for an operator (redrive), not lost.
    lost = [t for t in tasks if t.status not in ("completed", "dead_lettered")]
    dead = [t for t in tasks if t.status == "dead_lettered"]
    steps = Counter(Step.objects.filter(task_id__in=ids).values_list("task_id", "sequence"))
    twice = sum(1 for n in steps.values() if n > 1)
    takeovers = []
    for at, held in kills:
        for task_id in held:
            resumed = (
                AuditRecord.objects.filter(
                    task_id=task_id, from_status="recovering", to_status="working", created_at__gt=at
                )
                .order_by("seq")
                .first()
            )
            if resumed:
                takeovers.append((resumed.created_at - at).total_seconds())
    print(
        f"chaos: {args.tasks} document reviews x {args.docs} docs (batch {args.batch}, "
        f"{sum(t.steps_done for t in tasks)} steps), 2 workers, a kill every {low:g}-{high:g}s; "
        f"lease {SETTINGS['RUNTIME_LEASE_SECONDS']}s, heartbeat {SETTINGS['RUNTIME_HEARTBEAT_SECONDS']}s, "
        f"scan {SETTINGS['RUNTIME_SCAN_SECONDS']}s, max recoveries {args.max_recoveries}, "
        f"checkpoint every {args.every_steps} step(s)"
    )
    print(
        f"  ran {elapsed:.1f}s; kills: {len(kills)}; tasks held by the killed worker: "
        f"{sum(len(h) for _, h in kills)}; recoveries: {sum(t.recoveries for t in tasks)}"
    )
    print(f"  tasks lost (neither completed nor held as a dead letter): {len(lost)}")
    print(
        f"  steps committed twice: {twice}"
        + (
            ""
            if args.every_steps == 1
            else f" (expected with --every-steps {args.every_steps}: steps after a checkpoint re-run after a kill)"
        )
    )
    print(f"  dead letters: {len(dead)}")
    if takeovers:
        print(
            f"  kill -> new lease takeover: p50 {statistics.median(takeovers):.2f}s, "
            f"p99 {_common.percentile(takeovers, 99):.2f}s, max {max(takeovers):.2f}s (n={len(takeovers)})"
        )
    print(f"  logs: {logs}")
    raise SystemExit(1 if lost or (twice and args.every_steps == 1) else 0)


if __name__ == "__main__":
    main()
