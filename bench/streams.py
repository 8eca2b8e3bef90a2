"""SSE delivery: commit → client latency, and many concurrent streams on one web process.

    .venv/bin/python bench/streams.py --streams 500 --rounds 2 --baseline main

One uvicorn process at a time and one worker on PostgreSQL and Redis. A no-op task emits
events (progress is coalesced to one per 100 ms here); this process holds the SSE clients
(asyncio, one raw HTTP/1.1 connection each: see _common.RawHttp; `--client httpx` measures
with httpx as before, whose CPU per event, not the server's, then sets the latency).
Latency is the time from the event row's insert (just before its commit) to its arrival at
a client. First 1 stream (the baseline), then N streams on the same web process; also
reported: the web process's RSS, the database connections it holds while the N streams are
open, and its CPU per delivered event. With --baseline a git ref's web process (exported
with `git archive`) is measured against the same database and worker in interleaved rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

SEQ = re.compile(r'"seq": ?([0-9]+)')


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def listen_raw(
    base: str, token: str, task_id: str, received: list[tuple[int, float]], ready: asyncio.Event
) -> None:
    client = _common.RawHttp(base, token)
    last, buffer = -1, ""
    try:
        async for chunk in client.stream(f"/runtime/tasks/{task_id}/events"):
            arrived = time.time()
            buffer += chunk
            *events, buffer = buffer.split("\n\n")
            for event in events:
                kind = event.partition("event: ")[2].partition("\n")[0]
                if kind in ("", "stream-open", "keep-alive") or (seq := SEQ.search(event)) is None:
                    continue
                n = int(seq.group(1))
                if kind == "task.snapshot":
                    ready.set()
                elif n > last:
                    received.append((n, arrived))
                last = max(last, n)
                if kind == "terminal":
                    return
    finally:
        await client.close()


async def listen_httpx(
    base: str, token: str, task_id: str, received: list[tuple[int, float]], ready: asyncio.Event
) -> None:
    import httpx

    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(30, read=None)) as client,
        client.stream(
            "GET", f"{base}/runtime/tasks/{task_id}/events", headers={"Authorization": f"Bearer {token}"}
        ) as r,
    ):
        kind, last = None, -1
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:") and kind not in (None, "stream-open", "keep-alive"):
                seq = json.loads(line[5:])["seq"]
                if kind == "task.snapshot":
                    ready.set()
                elif seq > last:
                    received.append((seq, time.time()))
                last = max(last, seq)
                if kind == "terminal":
                    return


async def run(base: str, token: str, task_id: str, n: int, client: str) -> list[list[tuple[int, float]]]:
    listen = listen_raw if client == "raw" else listen_httpx
    results: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    readies = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(listen(base, token, task_id, results[i], readies[i])) for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), timeout=120)
    from asgiref.sync import sync_to_async

    await sync_to_async(resume)(task_id)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    return results


def resume(task_id: str) -> None:
    from tasks_app.models import Task
    from tasks_app.queue import enqueue_slice

    Task.objects.filter(id=task_id).update(status="queued")
    enqueue_slice(task_id, 5)


def latencies(task_id: str, results: list[list[tuple[int, float]]]) -> list[float]:
    from tasks_app.models import TaskEvent

    created = {
        seq: at.timestamp() for seq, at in TaskEvent.objects.filter(task_id=task_id).values_list("seq", "created_at")
    }
    return [(arrived - created[seq]) * 1000 for stream in results for seq, arrived in stream if seq in created]


def db_connections(name: str) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [name])
        return cursor.fetchone()[0]


def measure_streams(web: Any, base: str, token: str, tenant: Any, n: int, steps: int, client: str) -> dict[str, Any]:
    from tasks_app.models import Task

    task = Task.objects.create(
        tenant=tenant, created_by="user:bench", agent="noop", status="paused", input={"steps": steps, "sleepMs": 50}
    )
    held: dict[str, float] = {"rss": rss_mb(web.pid), "db": 0}
    idle_rss = held["rss"]

    async def measure() -> list[list[tuple[int, float]]]:
        from asgiref.sync import sync_to_async

        async def sample() -> None:
            while True:
                await asyncio.sleep(0.5)
                held["rss"] = max(held["rss"], rss_mb(web.pid))
                held["db"] = max(held["db"], await sync_to_async(db_connections)("bench-web"))

        sampler = asyncio.create_task(sample())
        try:
            return await run(base, token, str(task.id), n, client)
        finally:
            sampler.cancel()

    web_cpu, own = _common.cpu_seconds(web.pid), resource.getrusage(resource.RUSAGE_SELF)
    results = asyncio.run(measure())
    web_cpu = _common.cpu_seconds(web.pid) - web_cpu
    after = resource.getrusage(resource.RUSAGE_SELF)
    lat = latencies(str(task.id), results)
    final = Task.objects.get(id=task.id).event_seq
    return {
        "n": n,
        "lat": lat,
        "complete": sum(1 for r in results if r and r[-1][0] == final),
        "idle_rss": idle_rss,
        "rss": held["rss"],
        "db": held["db"],
        "web_ms_per_event": web_cpu * 1000 / max(1, len(lat)),
        "client_ms_per_event": (after.ru_utime + after.ru_stime - own.ru_utime - own.ru_stime)
        * 1000
        / max(1, len(lat)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--baseline", help="a git ref to measure beside this checkout, e.g. main")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw")
    args = parser.parse_args()
    _common.setup(STREAM_PROGRESS_INTERVAL_MS="100")

    tenant, token = _common.operator_key()
    logs = Path(tempfile.mkdtemp(prefix="bench-streams-"))
    builds = {"this checkout": _common.ROOT}
    if args.baseline:
        builds = {args.baseline: _common.export(args.baseline), **builds}
    worker = _common.worker(logs / "worker.log")
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in builds}
    try:
        for round_ in range(args.rounds):
            for name, folder in builds.items():
                web, base = _common.web(
                    logs, cwd=folder, DATABASE_URL=os.environ["DATABASE_URL"] + "?application_name=bench-web"
                )
                try:
                    for n in (1, args.streams) if round_ == 0 else (args.streams,):
                        rows[name].append(measure_streams(web, base, token, tenant, n, args.steps, args.client))
                finally:
                    web.terminate()
                    web.wait()
    finally:
        worker.terminate()
        worker.wait()
        for folder in builds.values():
            if folder != _common.ROOT:
                shutil.rmtree(folder, ignore_errors=True)
    print(
        f"SSE delivery; one uvicorn process at a time, one worker; a {args.steps}-step no-op task, 50 ms steps; "
        f"{args.client} client; {args.rounds} round(s), builds interleaved; load average {os.getloadavg()[0]:.1f}"
    )
    for name, measured in rows.items():
        for n in sorted({r["n"] for r in measured}):
            runs = [r for r in measured if r["n"] == n]
            lat = [x for r in runs for x in r["lat"]]
            print(
                f"  {name:14} {n:4d} stream(s): commit->client p50 {statistics.median(lat):7.1f} ms, "
                f"p95 {_common.percentile(lat, 95):7.1f} ms ({len(lat)} deliveries); saw the terminal event: "
                f"{sum(r['complete'] for r in runs)}/{n * len(runs)}; web RSS {runs[0]['idle_rss']:.0f} -> "
                f"{max(r['rss'] for r in runs):.0f} MB; web DB connections held (max) {max(r['db'] for r in runs):.0f}; "
                f"web CPU {statistics.mean(r['web_ms_per_event'] for r in runs):.3f} ms/delivery "
                f"(client {statistics.mean(r['client_ms_per_event'] for r in runs):.3f})"
            )
    print("target: 500 streams, commit->client p95 <= 50 ms, <= 8 database connections held")


if __name__ == "__main__":
    main()
