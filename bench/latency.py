"""Start latency on an idle worker: submit -> first step, and a synchronous MCP tools/call
of a one-step agent, round trip; before and after in one run.

    .venv/bin/python bench/latency.py --calls 40 --rounds 3 [--baseline main]

One uvicorn process and one worker (-c 1), both idle between calls (each call starts once
the one before has ended and its worker has gone quiet). Per build (this checkout and,
with --baseline, a git ref exported to a temp folder: its own web process and worker, the
same database), in interleaved rounds:

- submit -> first step: POST /runtime/tasks of a `noop` task of 2 steps; from just before
  the request until the first step's row says it finished (Step.finished_at, the worker's
  clock: the same machine's). Also reported: the POST's own round trip and
  submit -> started_at (the first slice's claim and load).
- MCP tools/call: a synchronous `tools/call` of `greet` (the test fixtures' one-step agent,
  taskSupport forbidden: the server answers once the run has ended; the bench runs with
  DJANGO_SETTINGS_MODULE=tests.settings, which adds the fixtures), the client's round trip.

Prints p50/p95 per measure and build. Targets: submit -> first step p50 <= 20 ms, MCP
tools/call p50 <= 60 ms.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import _common

META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}


def submit(http, task_model, step_model) -> dict[str, float]:
    t0 = time.time()
    r = http.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 2}})
    posted = time.time()
    assert r.status_code == 201, r.text
    task_id = r.json()["taskId"]
    _common.wait(lambda: task_model.objects.filter(id=task_id, status="completed").exists(), 60, 0.005)
    task = task_model.objects.get(id=task_id)
    first = step_model.objects.get(task_id=task_id, sequence=1, attempt=1)
    return {
        "POST round trip": (posted - t0) * 1000,
        "submit -> started": (task.started_at.timestamp() - t0) * 1000,
        "submit -> first step": (first.finished_at.timestamp() - t0) * 1000,
        # Where it went: the request up to the task's row, the row to the first slice's
        # start (the commit, the message, the claim and the reads), that start to the step.
        "  submit -> created": (task.created_at.timestamp() - t0) * 1000,
        "  created -> started": (task.started_at - task.created_at).total_seconds() * 1000,
        "  started -> first step": (first.finished_at - task.started_at).total_seconds() * 1000,
    }


def mcp_call(http, modern: str) -> dict[str, float]:
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {
            "_meta": {**META, "io.modelcontextprotocol/protocolVersion": modern},
            "name": "greet",
            "arguments": {"name": "bench"},
        },
    }
    headers = {
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": modern,
        "Mcp-Method": "tools/call",
        "Mcp-Name": "greet",
    }
    t0 = time.perf_counter()
    r = http.post("/mcp", json=body, headers=headers)
    took = (time.perf_counter() - t0) * 1000
    assert r.status_code == 200 and '"isError":false' in r.text.replace(" ", ""), r.text
    return {"MCP tools/call": took}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a git ref to measure beside this checkout, e.g. main")
    args = parser.parse_args()
    _common.setup(DJANGO_SETTINGS_MODULE="tests.settings")
    import httpx

    from mcp_server.protocol import MODERN
    from tasks_app.models import Step, Task

    _, token = _common.operator_key()
    logs = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    builds = {"this checkout": _common.ROOT}
    if args.baseline:
        from _common import export

        builds = {args.baseline: export(args.baseline), **builds}
    results: dict[str, dict[str, list[float]]] = {name: {} for name in builds}
    try:
        for _ in range(args.rounds):
            for name, folder in builds.items():
                worker = _common.worker(logs / "worker.log", cwd=folder)
                web, base = _common.web(logs, cwd=folder)
                try:
                    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
                        submit(http, Task, Step), mcp_call(http, MODERN)  # warm-up: imports, connections
                        for _ in range(args.calls):
                            for got in (submit(http, Task, Step), mcp_call(http, MODERN)):
                                for key, value in got.items():
                                    results[name].setdefault(key, []).append(value)
                            time.sleep(0.05)  # idle: the worker is waiting for its next message
                finally:
                    for proc in (web, worker):
                        proc.terminate()
                        proc.wait()
    finally:
        for folder in builds.values():
            if folder != _common.ROOT:
                shutil.rmtree(folder, ignore_errors=True)

    print(
        f"one uvicorn process, one idle worker (-c 1); {args.calls} calls x {args.rounds} rounds per build, interleaved"
    )
    print(f"{'build':16} {'measure':22} {'p50 ms':>8} {'p95 ms':>8} {'n':>5}")
    for name, got in results.items():
        for key, values in got.items():
            print(
                f"{name:16} {key:22} {statistics.median(values):8.1f} {_common.percentile(values, 95):8.1f} {len(values):5}"
            )
    print("targets: submit -> first step p50 <= 20 ms; MCP tools/call (one-step agent) p50 <= 60 ms")


if __name__ == "__main__":
    main()
