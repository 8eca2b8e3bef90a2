"""Takeover: how long a task waits for another worker after its worker is killed or told to stop.

    .venv/bin/python bench/takeover.py --rounds 30 --mode kill term term-group

Three workers (prefork, -c 1) and beat against PostgreSQL and Redis (a fresh bench
database), lease 3 s, heartbeat 1 s, scan 1 s; two endless no-op tasks (200 ms steps), so
one worker is always free. Each round signals a worker that holds a task; the takeover
time runs from the signal to the moment another worker holds the task's lease (polled
every 10 ms). Then a replacement starts, and the next round waits until it is ready (a
worker still starting would take messages it cannot run yet). Modes:

    kill        SIGKILL to every process of the worker (a crash, OOM, a lost machine)
    term        SIGTERM to the worker's main process (docker stop, Kubernetes)
    term-group  SIGTERM to every process of the worker (systemd's default KillMode)

Prints p50, p99 and max per mode.
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
from pathlib import Path

import _common

SETTINGS = {
    "RUNTIME_LEASE_SECONDS": "3",
    "RUNTIME_HEARTBEAT_SECONDS": "1",
    "RUNTIME_SCAN_SECONDS": "1",
    "RUNTIME_STALL_SECONDS": "10",
    "RUNTIME_MAX_RECOVERIES": "100000",
}
SIGNALS = {"kill": (signal.SIGKILL, True), "term": (signal.SIGTERM, False), "term-group": (signal.SIGTERM, True)}


def group_of(owner: str) -> int | None:
    """The process group (= the worker's main pid) of a lease owner host:pid, if it lives."""
    try:
        return os.getpgid(int(owner.rsplit(":", 1)[1]))
    except ProcessLookupError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30, help="per mode")
    parser.add_argument("--mode", nargs="+", choices=sorted(SIGNALS), default=["kill", "term", "term-group"])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    for key, value in SETTINGS.items():
        os.environ.setdefault(key, value)
    _common.setup(DATABASE_URL="postgres://postgres@127.0.0.1:5432/runtime_takeover")

    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.models import Task, Tenant

    tenant = Tenant.objects.create(slug="takeover", name="takeover")
    logs = Path(tempfile.mkdtemp(prefix="takeover-"))
    beat = _common.start(
        ["celery", "-A", "runtime_site", "beat", "-l", "WARNING", "-s", str(logs / "beat")], logs / "beat.log"
    )
    workers = [ready_worker(logs / f"worker-{i}.log") for i in range(3)]
    ids = [
        do_create_task(console(tenant, "user:bench"), agent="noop", input={"steps": 1_000_000, "sleepMs": 200})[0].id
        for _ in range(2)
    ]
    results: dict[str, list[float]] = {mode: [] for mode in args.mode}
    try:
        for mode in args.mode:
            sig, whole_group = SIGNALS[mode]
            for _ in range(args.rounds):
                leases = wait_for_leases(Task, ids)
                victim = next(w for w in workers if w.pid in {group_of(o) for o, _ in leases.values()})
                held = {task_id: epoch for task_id, (owner, epoch) in leases.items() if group_of(owner) == victim.pid}
                signalled = time.monotonic()
                (os.killpg if whole_group else os.kill)(victim.pid, sig)
                pending = dict(held)
                while pending:
                    for task_id, owner, epoch in Task.objects.filter(id__in=pending).values_list(
                        "id", "lease_owner", "lease_epoch"
                    ):
                        if owner and epoch > pending[task_id] and group_of(owner) != victim.pid:
                            results[mode].append(time.monotonic() - signalled)
                            del pending[task_id]
                    if time.monotonic() - signalled > 120:
                        raise SystemExit(f"{mode}: no takeover within 120 s (logs: {logs})")
                    time.sleep(0.01)
                victim.wait(timeout=60)
                workers[workers.index(victim)] = ready_worker(logs / f"worker-{time.time():.0f}.log")
                time.sleep(rng.uniform(0.5, 1.5))
    finally:
        for proc in [*workers, beat]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    print(
        f"takeover after a worker is signalled: 3 workers (-c 1), 2 endless tasks of 200 ms steps; "
        f"lease {SETTINGS['RUNTIME_LEASE_SECONDS']}s, heartbeat {SETTINGS['RUNTIME_HEARTBEAT_SECONDS']}s, "
        f"scan {SETTINGS['RUNTIME_SCAN_SECONDS']}s, stall {SETTINGS['RUNTIME_STALL_SECONDS']}s"
    )
    for mode, times in results.items():
        print(
            f"  {mode:10s} p50 {statistics.median(times):.2f}s  p99 {_common.percentile(times, 99):.2f}s  "
            f"max {max(times):.2f}s  (n={len(times)})"
        )
    print(f"  logs: {logs}")


def ready_worker(log: Path):
    proc = _common.worker(log, "-l", "INFO")
    _common.wait(lambda: b" ready." in log.read_bytes(), timeout=120, interval=0.05)
    return proc


def wait_for_leases(task_model, ids) -> dict:
    """{task id: (owner, epoch)} once every task is held by a live worker."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = {
            t: (o, e)
            for t, o, e in task_model.objects.filter(id__in=ids).values_list("id", "lease_owner", "lease_epoch")
        }
        if all(o and group_of(o) for o, _ in rows.values()):
            return rows
        time.sleep(0.05)
    raise SystemExit("the tasks were not all held by live workers within 120 s")


if __name__ == "__main__":
    main()
