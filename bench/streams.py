"""SSE delivery: commit → client latency, and many concurrent streams on one web process.

    .venv/bin/python bench/streams.py --streams 500

One uvicorn process and one worker on PostgreSQL and Redis. A no-op task emits events
(progress is coalesced to one per 100 ms here); this process holds the SSE clients
(asyncio + httpx). Latency is the time from the event row's insert (just before its
commit) to its arrival at a client. Run first with 1 stream (the baseline), then with N
streams on the same web process; also reported: the web process's RSS and the database
connections it holds while the N streams are open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import _common


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def listen(
    base: str, token: str, task_id: str, received: list[tuple[int, float]], ready: asyncio.Event, stop: asyncio.Event
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
                if kind == "terminal" or stop.is_set():
                    return


async def run(base: str, token: str, task_id: str, n: int) -> list[list[tuple[int, float]]]:
    stop = asyncio.Event()
    results: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    readies = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(listen(base, token, task_id, results[i], readies[i], stop)) for i in range(n)]
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    _common.setup(STREAM_PROGRESS_INTERVAL_MS="100")
    from tasks_app.models import Task

    tenant, token = _common.operator_key()
    logs = Path(tempfile.mkdtemp(prefix="bench-streams-"))
    web, base = _common.web(logs, DATABASE_URL=os.environ["DATABASE_URL"] + "?application_name=bench-web")
    worker = _common.worker(logs / "worker.log")
    rows = []
    try:
        for n in (1, args.streams):
            task = Task.objects.create(
                tenant=tenant,
                created_by="user:bench",
                agent="noop",
                status="paused",
                input={"steps": args.steps, "sleepMs": 50},
            )
            idle_rss = rss_mb(web.pid)
            holder: dict[str, float] = {}

            async def measure(
                n: int = n, task_id: str = str(task.id), holder: dict[str, float] = holder
            ) -> list[list[tuple[int, float]]]:
                async def sample() -> None:
                    from asgiref.sync import sync_to_async

                    while True:
                        await asyncio.sleep(0.5)
                        holder["rss"] = max(holder.get("rss", 0), rss_mb(web.pid))
                        holder["db"] = max(holder.get("db", 0), await sync_to_async(db_connections)())

                sampler = asyncio.create_task(sample())
                try:
                    return await run(base, token, task_id, n)
                finally:
                    sampler.cancel()

            results = asyncio.run(measure())
            lat = latencies(str(task.id), results)
            complete = sum(1 for r in results if r and r[-1][0] == Task.objects.get(id=task.id).event_seq)
            rows.append((n, lat, complete, idle_rss, holder.get("rss", 0), holder.get("db", 0)))
    finally:
        for proc in (web, worker):
            proc.terminate()
            proc.wait()
    print(f"SSE delivery; one uvicorn process, one worker; a {args.steps}-step no-op task, 50 ms steps")
    for n, lat, complete, idle, peak, db in rows:
        print(
            f"  {n:4d} stream(s): commit->client p50 {statistics.median(lat):6.1f} ms, "
            f"p95 {_common.percentile(lat, 95):6.1f} ms ({len(lat)} deliveries); streams that saw the terminal "
            f"event: {complete}/{n}; web RSS {idle:.0f} -> {peak:.0f} MB; web DB connections held (max) {db:.0f}"
        )


def db_connections() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'bench-web'")
        return cursor.fetchone()[0]


if __name__ == "__main__":
    main()
