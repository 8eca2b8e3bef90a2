"""Reads and writes on one web process under concurrent readers, before and after, in one run.

    .venv/bin/python bench/api.py --readers 50 --seconds 10 --baseline main

One uvicorn process at a time against one PostgreSQL + Redis, 100 running no-op tasks
(one worker, -c 1, 20 ms steps, so rows change under the readers). For each web build
(this checkout, and with --baseline a git ref exported to a temp folder: the same
database, the same client), in interleaved rounds:

1. idle: GET /healthz and GET /runtime/tasks/{id} one at a time (p50);
2. load: N readers in a loop, each GET /runtime/tasks/{id} of a random task, for S s; beside
   them one client doing GET /runtime/tasks?limit=50 (the list), one creating tasks
   (POST /runtime/tasks), one steering (POST .../steering set_priority on a fresh version)
   and one GET /healthz; each timed per request.

Prints p50/p95/p99 per request kind and build, reads/s, and the issue's targets
(snapshot p95 <= 20 ms, create p95 <= 40 ms, steering accept p99 <= 50 ms, healthz p50 <= 2 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import _common


def export(ref: str) -> Path:
    """`ref` of this repository as plain files in a temp folder (no worktree, no checkout)."""
    folder = Path(tempfile.mkdtemp(prefix=f"bench-api-{ref.replace('/', '_')}-"))
    archive = subprocess.run(["git", "archive", ref], cwd=_common.ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


async def timed(samples: list[float], call) -> object:
    t0 = time.perf_counter()
    response = await call
    samples.append((time.perf_counter() - t0) * 1000)
    return response


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far: the machine is shared, so beside latency
    the bench reports what a request costs the web process, which other load does not move."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    base: str, token: str, task_ids: list[str], readers: int, seconds: float, pid: int
) -> dict[str, list[float]]:
    import httpx

    out: dict[str, list[float]] = {
        k: [] for k in ("idle healthz", "idle snapshot", "snapshot", "list", "create", "steer accept", "healthz")
    }
    limits = httpx.Limits(max_connections=readers + 8, max_keepalive_connections=readers + 8)
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, limits=limits, timeout=30
    ) as http:
        for _ in range(100):
            await timed(out["idle healthz"], http.get("/healthz"))
        for _ in range(100):
            await timed(out["idle snapshot"], http.get(f"/runtime/tasks/{random.choice(task_ids)}"))
        stop = time.monotonic() + seconds
        steer_task = task_ids[0]

        async def reader() -> None:
            while time.monotonic() < stop:
                r = await timed(out["snapshot"], http.get(f"/runtime/tasks/{random.choice(task_ids)}"))
                assert r.status_code == 200, r.text

        async def lister() -> None:
            while time.monotonic() < stop:
                r = await timed(out["list"], http.get("/runtime/tasks?limit=50"))
                assert r.status_code == 200, r.text

        async def creator() -> None:
            while time.monotonic() < stop:
                r = await timed(
                    out["create"], http.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 1}})
                )
                assert r.status_code == 201, r.text
                await asyncio.sleep(0.02)

        async def steerer() -> None:
            while time.monotonic() < stop:
                version = (await http.get(f"/runtime/tasks/{steer_task}")).json()["stateVersion"]
                body = {
                    "commandId": f"c{time.monotonic_ns()}",
                    "type": "set_priority",
                    "payload": {"priority": random.randint(0, 9)},
                    "expectedVersion": version,
                }
                t0 = time.perf_counter()
                r = await http.post(f"/runtime/tasks/{steer_task}/steering", json=body)
                if r.status_code == 202:  # a 409 (the worker moved the version) is retried, not timed
                    out["steer accept"].append((time.perf_counter() - t0) * 1000)
                else:
                    assert r.status_code == 409, r.text
                await asyncio.sleep(0.02)

        async def health() -> None:
            while time.monotonic() < stop:
                await timed(out["healthz"], http.get("/healthz"))
                await asyncio.sleep(0.02)

        cpu = cpu_seconds(pid)
        await asyncio.gather(*(reader() for _ in range(readers)), lister(), creator(), steerer(), health())
        cpu = cpu_seconds(pid) - cpu
    out["reads/s"] = [len(out["snapshot"]) / seconds]
    served = sum(len(out[k]) for k in ("snapshot", "list", "create", "steer accept", "healthz"))
    out["cpu ms/request"] = [cpu * 1000 / served]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--readers", type=int, default=50)
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", help="a git ref to measure beside this checkout, e.g. main")
    args = parser.parse_args()
    _common.setup(RUNTIME_SLICE_STEPS="50")
    from tasks_app.access import console
    from tasks_app.actions import do_create_task

    tenant, token = _common.operator_key()
    logs = Path(tempfile.mkdtemp(prefix="bench-api-"))
    task_ids = [
        str(
            do_create_task(console(tenant, "user:bench"), agent="noop", input={"steps": 1_000_000, "sleepMs": 20})[0].id
        )
        for _ in range(args.tasks)
    ]
    builds = {"this checkout": _common.ROOT}
    if args.baseline:
        builds = {args.baseline: export(args.baseline), **builds}
    worker = _common.worker(logs / "worker.log")
    results: dict[str, dict[str, list[float]]] = {name: {} for name in builds}
    try:
        for _ in range(args.rounds):
            for name, folder in builds.items():
                # Keep-alive past uvicorn's 5 s: a pooled client connection idle that long
                # under load is closed under the request that reuses it.
                web, base = _common.web(logs, "--timeout-keep-alive", "120", cwd=folder)
                try:
                    got = asyncio.run(measure(base, token, task_ids, args.readers, args.seconds, web.pid))
                finally:
                    web.terminate()
                    web.wait()
                for key, values in got.items():
                    results[name].setdefault(key, []).extend(values)
    finally:
        worker.terminate()
        worker.wait()
        for folder in builds.values():
            if folder != _common.ROOT:
                shutil.rmtree(folder, ignore_errors=True)

    print(
        f"one uvicorn process; {args.tasks} running no-op tasks (one worker -c 1); {args.readers} concurrent "
        f"snapshot readers + 1 list, 1 create, 1 steering, 1 healthz client; {args.rounds} x {args.seconds:g} s "
        f"per build, interleaved"
    )
    print(f"{'build':16} {'request':16} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'n':>7}")
    for name, got in results.items():
        for key in ("idle healthz", "idle snapshot", "snapshot", "list", "create", "steer accept", "healthz"):
            values = got.get(key) or [float("nan")]
            print(
                f"{name:16} {key:16} {statistics.median(values):8.2f} {_common.percentile(values, 95):8.2f} "
                f"{_common.percentile(values, 99):8.2f} {len(got.get(key, [])):7}"
            )
        print(f"{name:16} {'reads/s':16} {statistics.mean(got['reads/s']):8.0f}")
        print(
            f"{name:16} {'web CPU ms/req':16} {statistics.mean(got['cpu ms/request']):8.2f}   (under load, all kinds)"
        )
    print("targets: snapshot p95 <= 20 ms, create p95 <= 40 ms, steer accept p99 <= 50 ms, idle healthz p50 <= 2 ms")


if __name__ == "__main__":
    main()
