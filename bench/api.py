"""Reads and writes on one web process under concurrent readers, before and after, in one run.

    .venv/bin/python bench/api.py --readers 50 --seconds 10 --baseline main
    .venv/bin/python bench/api.py --readers 50 --seconds 10 --baseline main --rate 2   # open loop

One uvicorn process at a time against one PostgreSQL + Redis, 100 running no-op tasks
(one worker, -c 1, 20 ms steps, so rows change under the readers). For each web build
(this checkout, and with --baseline a git ref exported to a temp folder: the same
database, the same client), in interleaved rounds:

1. idle: GET /healthz and GET /runtime/tasks/{id} one at a time, then 20 creates and 20
   steering commands one at a time; the first of each kind, the process's first write, is
   printed on its own ("first create", "first steer accept"), apart from the load below;
2. load: N readers in a loop, each GET /runtime/tasks/{id} of a random task, for S s; beside
   them one client doing GET /runtime/tasks?limit=50 (the list), one creating tasks
   (POST /runtime/tasks), one steering (POST .../steering set_priority on a fresh version)
   and one GET /healthz; each timed per request.

The readers are closed loop by default (each sends its next read when the last is answered,
so latency is the queue of 50 in the web process; the side clients go again at once or after
20 ms). With --rate R each reader sends R reads a second on a fixed schedule (open loop), and
a read's latency runs from when it was due, so a read that had to wait for the one before
it counts the wait; the list, create and steering clients then send about R a second each
and /healthz 5 R.

Each client is one keep-alive connection of _common.RawHttp: httpx costs 3-4 ms of CPU per
request on this machine, more than the web process it measures, which then waits on the
client; `--client httpx` measures with it as before. The client's own CPU per request is
printed beside the web process's.

Prints p50/p95/p99 per request kind and build, reads/s, and the issue's targets
(snapshot p95 <= 20 ms, create p95 <= 40 ms, steering accept p99 <= 50 ms, healthz p50 <= 2 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _common


async def timed(samples: list[float], call: Any, since: float | None = None) -> Any:
    t0 = time.perf_counter() if since is None else since
    response = await call
    samples.append((time.perf_counter() - t0) * 1000)
    return response


class HttpxClient:
    """The RawHttp interface over one httpx client (--client httpx)."""

    def __init__(self, http: Any) -> None:
        self.http = http

    async def request(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        r = await self.http.request(method, path, json=body)
        return r.status_code, r.content

    async def close(self) -> None:
        pass


KINDS = (
    "idle healthz",
    "idle snapshot",
    "first create",
    "first steer accept",
    "idle create",
    "idle steer accept",
    "snapshot",
    "list",
    "create",
    "steer accept",
    "healthz",
)
CREATE = {"agent": "noop", "input": {"steps": 1}}
IDLE_WRITES = 20


async def steer(conn: Any, task_id: str) -> tuple[int, bytes, float]:
    """One set_priority on the task's current version: (status, answer, ms of the POST)."""
    version = json.loads((await conn.request("GET", f"/runtime/tasks/{task_id}"))[1])["stateVersion"]
    body = {
        "commandId": f"c{time.monotonic_ns()}",
        "type": "set_priority",
        "payload": {"priority": random.randint(0, 9)},
        "expectedVersion": version,
    }
    t0 = time.perf_counter()
    status, answer = await conn.request("POST", f"/runtime/tasks/{task_id}/steering", body)
    return status, answer, (time.perf_counter() - t0) * 1000


async def measure(
    base: str, token: str, task_ids: list[str], readers: int, seconds: float, pid: int, rate: float, client: str
) -> dict[str, list[float]]:
    import httpx

    out: dict[str, list[float]] = {k: [] for k in KINDS}
    limits = httpx.Limits(max_connections=readers + 8, max_keepalive_connections=readers + 8)
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, limits=limits, timeout=30
    ) as http:

        def connection() -> Any:
            return _common.RawHttp(base, token) if client == "raw" else HttpxClient(http)

        idle = connection()
        for _ in range(100):
            await timed(out["idle healthz"], idle.request("GET", "/healthz"))
        for _ in range(100):
            await timed(out["idle snapshot"], idle.request("GET", f"/runtime/tasks/{random.choice(task_ids)}"))
        steer_task = task_ids[0]
        # A fresh process's first writes, apart: the load below measures a process past them,
        # as one that has served for hours is. Then writes one at a time, without the load.
        for i in range(IDLE_WRITES):
            status, answer = await timed(
                out["first create" if i == 0 else "idle create"], idle.request("POST", "/runtime/tasks", CREATE)
            )
            assert status == 201, answer
        while len(out["idle steer accept"]) < IDLE_WRITES - 1:
            status, answer, ms = await steer(idle, steer_task)
            if status == 202:
                out["idle steer accept" if out["first steer accept"] else "first steer accept"].append(ms)
            else:
                assert status == 409, answer
        await idle.close()
        stop = time.monotonic() + seconds

        async def reader() -> None:
            conn = connection()
            due = time.perf_counter() + random.random() / rate if rate else None
            while time.monotonic() < stop:
                if due is not None:  # open loop: the read is due now, answered or not the last one
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                path = f"/runtime/tasks/{random.choice(task_ids)}"
                status, body = await timed(out["snapshot"], conn.request("GET", path), since=due)
                assert status == 200, body
                if due is not None:
                    due += 1 / rate
            await conn.close()

        async def pause(default: float, per_second: float) -> None:
            """Between two requests of a side client: closed loop as before, or paced (open loop)."""
            await asyncio.sleep(1 / per_second if rate else default)

        async def lister() -> None:
            conn = connection()
            while time.monotonic() < stop:
                status, body = await timed(out["list"], conn.request("GET", "/runtime/tasks?limit=50"))
                assert status == 200, body
                await pause(0, rate)
            await conn.close()

        async def creator() -> None:
            conn = connection()
            while time.monotonic() < stop:
                status, answer = await timed(out["create"], conn.request("POST", "/runtime/tasks", CREATE))
                assert status == 201, answer
                await pause(0.02, rate)
            await conn.close()

        async def steerer() -> None:
            conn = connection()
            while time.monotonic() < stop:
                status, answer, ms = await steer(conn, steer_task)
                if status == 202:  # a 409 (the worker moved the version) is retried, not timed
                    out["steer accept"].append(ms)
                else:
                    assert status == 409, answer
                await pause(0.02, rate)
            await conn.close()

        async def health() -> None:
            conn = connection()
            while time.monotonic() < stop:
                await timed(out["healthz"], conn.request("GET", "/healthz"))
                await pause(0.02, 5 * rate)
            await conn.close()

        cpu, own = _common.cpu_seconds(pid), resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.gather(*(reader() for _ in range(readers)), lister(), creator(), steerer(), health())
        cpu = _common.cpu_seconds(pid) - cpu
        after = resource.getrusage(resource.RUSAGE_SELF)
    out["reads/s"] = [len(out["snapshot"]) / seconds]
    served = sum(len(out[k]) for k in ("snapshot", "list", "create", "steer accept", "healthz"))
    out["cpu ms/request"] = [cpu * 1000 / served]
    client_cpu = after.ru_utime + after.ru_stime - own.ru_utime - own.ru_stime
    out["client cpu ms/request"] = [client_cpu * 1000 / served]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--readers", type=int, default=50)
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", help="a git ref to measure beside this checkout, e.g. main")
    parser.add_argument("--rate", type=float, default=0, help="reads per second per reader (open loop); 0: closed loop")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw")
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
        builds = {args.baseline: _common.export(args.baseline), **builds}
    worker = _common.worker(logs / "worker.log")
    results: dict[str, dict[str, list[float]]] = {name: {} for name in builds}
    try:
        for _ in range(args.rounds):
            for name, folder in builds.items():
                # Keep-alive past uvicorn's 5 s: a pooled client connection idle that long
                # under load is closed under the request that reuses it.
                web, base = _common.web(logs, "--timeout-keep-alive", "120", cwd=folder)
                try:
                    got = asyncio.run(
                        measure(base, token, task_ids, args.readers, args.seconds, web.pid, args.rate, args.client)
                    )
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

    loop = f"open loop, {args.rate:g} reads/s each" if args.rate else "closed loop"
    print(
        f"one uvicorn process; {args.tasks} running no-op tasks (one worker -c 1); {args.readers} concurrent "
        f"snapshot readers ({loop}) + 1 list, 1 create, 1 steering, 1 healthz client; {args.client} client; "
        f"{args.rounds} x {args.seconds:g} s per build, interleaved; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'build':16} {'request':18} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'n':>7}")
    for name, got in results.items():
        for key in KINDS:
            values = got.get(key) or [float("nan")]
            print(
                f"{name:16} {key:18} {statistics.median(values):8.2f} {_common.percentile(values, 95):8.2f} "
                f"{_common.percentile(values, 99):8.2f} {len(got.get(key, [])):7}"
            )
        print(f"{name:16} {'reads/s':18} {statistics.mean(got['reads/s']):8.0f}")
        print(
            f"{name:16} {'web CPU ms/req':18} {statistics.mean(got['cpu ms/request']):8.2f}   (under load, all kinds)"
        )
        print(f"{name:16} {'client CPU ms/req':18} {statistics.mean(got['client cpu ms/request']):8.2f}")
    print("targets: snapshot p95 <= 20 ms, create p95 <= 40 ms, steer accept p99 <= 50 ms, idle healthz p50 <= 2 ms")


if __name__ == "__main__":
    main()
