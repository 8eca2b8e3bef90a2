"""What one write request costs the web process: SQL statements and CPU, before and after, in one run.

    .venv/bin/python bench/request_cost.py --requests 300 --rounds 3 --baseline main

In process (the build's own code, through Django's test client through the whole middleware chain and DRF, no server, no
network): POST /runtime/tasks/{id}/steering (set_priority on an idle task, the accept that
bench/api.py times) and POST /runtime/tasks (a one-step noop). For each request kind, the
SQL statements one request runs (BEGIN and COMMIT not counted) and the CPU time per request
of this process (client and server, which share it; the client's part is the same for every
build). With --baseline a git ref, exported to a temp folder, runs the same in a process of
its own code, in interleaved rounds, each build on a fresh database of its own. CPU time moves
less with other load on the machine than wall time, which is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _common


def measure(requests: int, root: Path) -> dict[str, dict[str, float]]:
    _common.setup(root)
    from django.db import connection
    from django.test import Client

    from tasks_app.access import console
    from tasks_app.actions import do_create_task

    tenant, token = _common.operator_key()
    task = do_create_task(console(tenant, "user:bench"), agent="noop", input={"steps": 10})[0]
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    version = client.get(f"/runtime/tasks/{task.id}").json()["stateVersion"]

    def steer(i: int) -> None:
        nonlocal version
        body = {
            "commandId": f"c{i}",
            "type": "set_priority",
            "payload": {"priority": i % 10},
            "expectedVersion": version,
        }
        answer = client.post(f"/runtime/tasks/{task.id}/steering", body, content_type="application/json")
        assert answer.status_code == 202, answer.content
        version = answer.json()["version"]

    def create(i: int) -> None:
        answer = client.post(
            "/runtime/tasks", {"agent": "noop", "input": {"steps": 1}}, content_type="application/json"
        )
        assert answer.status_code == 201, answer.content

    out = {}
    for name, call in (("steering accept", steer), ("create", create)):
        for i in range(30):  # warm: imports, caches, the pool
            call(i)
        statements: list[str] = []
        with connection.execute_wrapper(counting(statements)):
            call(10**6)
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(requests):
            call(10**5 + i)
        out[name] = {
            "statements": len(statements),
            "cpu ms": (time.process_time() - cpu) / requests * 1000,
            "wall ms": (time.perf_counter() - wall) / requests * 1000,
        }
    return out


def counting(statements: list[str]) -> Any:
    """A database execute wrapper that notes each statement's SQL in `statements`."""

    def wrapper(execute: Any, sql: str, *rest: Any) -> Any:
        statements.append(sql)
        return execute(sql, *rest)

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a git ref to measure beside this checkout, e.g. main")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a single build's run: its folder
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.requests, Path(args.one))))
        return
    builds = {"this checkout": _common.ROOT}
    if args.baseline:
        builds = {args.baseline: _common.export(args.baseline), **builds}
    base = os.environ.get("DATABASE_URL", _common.DEFAULTS["DATABASE_URL"])
    results: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in builds}
    try:
        for _ in range(args.rounds):
            for i, (name, folder) in enumerate(builds.items()):
                run = subprocess.run(
                    [sys.executable, __file__, "--one", str(folder), "--requests", str(args.requests)],
                    env={**os.environ, "DATABASE_URL": f"{base}_cost{i}", "RUNTIME_LOG_LEVEL": "ERROR"},
                    check=True,
                    capture_output=True,
                    text=True,
                )
                results[name].append(json.loads(run.stdout.strip().splitlines()[-1]))
    finally:
        for folder in builds.values():
            if folder != _common.ROOT:
                shutil.rmtree(folder, ignore_errors=True)
    print(
        f"{args.requests} requests per kind per round, {args.rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'build':16} {'request':16} {'statements':>10} {'CPU ms':>8} {'wall ms':>8}")
    medians: dict[str, dict[str, float]] = {}
    for name, runs in results.items():
        for kind in runs[0]:
            cpu = statistics.median(r[kind]["cpu ms"] for r in runs)
            wall = statistics.median(r[kind]["wall ms"] for r in runs)
            medians.setdefault(kind, {})[name] = cpu
            print(f"{name:16} {kind:16} {runs[0][kind]['statements']:10.0f} {cpu:8.2f} {wall:8.2f}")
    if args.baseline:
        for kind, by_build in medians.items():
            print(
                f"{kind}: CPU per request {by_build['this checkout'] / by_build[args.baseline]:.2f} x {args.baseline}"
            )


if __name__ == "__main__":
    main()
