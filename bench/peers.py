"""Per durable step: this runtime beside DBOS Transact and LangGraph, in interleaved rounds.

    /work/venv-bench: python3.12 -m venv /work/venv-bench && /work/venv-bench/bin/pip install -r bench/requirements.txt
    .venv/bin/python bench/peers.py --steps 1000 --rounds 3 --peer-python /work/venv-bench/bin/python [--baseline main]

The same workload everywhere: N sequential no-op steps, each made durable before the next
starts, on the same PostgreSQL (fsync as configured) on loopback. Reported: the median
ms per step over the rounds, and ratios.

- runtime: a `noop` task of N steps on one real worker process (-c 1, default slices and
  checkpoint policy), from creation to finished_at: one fenced commit per step (task row,
  step row), checkpoints by policy, a broker hop per slice.
- dbos: a @DBOS.workflow calling a @DBOS.step N times (each step's output recorded in its
  system database before the next runs).
- langgraph: a one-node StateGraph looping N times, PostgresSaver, durability="sync"
  (each step's checkpoint written before the next step).
- pg: one PostgreSQL transaction per step (update a row, insert a row, commit) with
  psycopg: what a durable step cannot go below.

The peers run in their own environment (bench/requirements.txt; --peer-python), each
round in a fresh process, so their dependencies never meet the project's.
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
import uuid
from urllib.parse import urlsplit

HERE = os.path.dirname(os.path.abspath(__file__))


# --- the peers (run with --run in the peers' environment) -------------------------------


def fresh_database(base_url: str, name: str) -> str:
    import psycopg

    url = urlsplit(base_url)
    with psycopg.connect(
        host=url.hostname,
        port=url.port or 5432,
        user=url.username,
        password=url.password,
        dbname="postgres",
        autocommit=True,
    ) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return url._replace(path=f"/{name}").geturl()


def run_pg(url: str, n: int) -> float:
    import psycopg

    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE run (id int PRIMARY KEY, done int NOT NULL)")
        conn.execute("CREATE TABLE step (run int, seq int, name text, PRIMARY KEY (run, seq))")
        conn.execute("INSERT INTO run VALUES (1, 0)")
        conn.commit()
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            with conn.transaction():
                conn.execute("UPDATE run SET done = %s WHERE id = 1", (i,))
                conn.execute("INSERT INTO step VALUES (1, %s, %s)", (i, f"noop-{i}"))
        return time.perf_counter() - t0


def run_dbos(url: str, n: int) -> float:
    from dbos import DBOS

    DBOS(config={"name": "bench-peers", "system_database_url": url})

    @DBOS.step()
    def noop(i: int) -> int:
        return i

    @DBOS.workflow()
    def workflow(count: int) -> int:
        for i in range(count):
            noop(i)
        return count

    DBOS.launch()
    try:
        workflow(20)  # warm-up: connections, prepared paths
        t0 = time.perf_counter()
        assert workflow(n) == n
        return time.perf_counter() - t0
    finally:
        DBOS.destroy()


def run_langgraph(url: str, n: int) -> float:
    from typing import TypedDict

    from langgraph.checkpoint.postgres import PostgresSaver
    from langgraph.graph import END, START, StateGraph

    class State(TypedDict):
        i: int

    with PostgresSaver.from_conn_string(url) as saver:
        saver.setup()

        def run(count: int) -> float:
            builder = StateGraph(State)
            builder.add_node("step", lambda state: {"i": state["i"] + 1})
            builder.add_edge(START, "step")
            builder.add_conditional_edges("step", lambda state: END if state["i"] >= count else "step")
            app = builder.compile(checkpointer=saver)
            config = {"configurable": {"thread_id": uuid.uuid4().hex}, "recursion_limit": count + 10}
            t0 = time.perf_counter()
            out = app.invoke({"i": 0}, config, durability="sync")
            assert out["i"] == count, out
            return time.perf_counter() - t0

        run(20)  # warm-up
        return run(n)


PEERS = {"pg": run_pg, "dbos": run_dbos, "langgraph": run_langgraph}


# --- the runtime and the rounds (run in the project's environment) -----------------------


def runtime(n: int, tenant: object) -> float:
    import _common

    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.models import Task

    start = time.time()
    task, _ = do_create_task(console(tenant, "user:bench"), agent="noop", input={"steps": n})
    _common.wait(lambda: Task.objects.filter(id=task.id, status="completed").exists(), interval=0.005)
    task.refresh_from_db()
    assert task.steps_done == n, task.steps_done
    return task.finished_at.timestamp() - start


def peer(python: str, name: str, n: int, base_url: str) -> float:
    out = subprocess.run(
        [python, __file__, "--run", name, "--steps", str(n), "--database-url", base_url],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peer-python", default="/work/venv-bench/bin/python")
    parser.add_argument("--peers", default="pg,dbos,langgraph")
    parser.add_argument("--baseline", help="a git ref whose runtime to measure beside this checkout, e.g. main")
    parser.add_argument("--run", choices=sorted(PEERS), help=argparse.SUPPRESS)
    parser.add_argument(
        "--database-url", default=os.getenv("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/runtime_bench")
    )
    args = parser.parse_args()
    if args.run:  # one peer, one round, in the peers' environment
        url = fresh_database(args.database_url, f"bench_peer_{args.run}")
        print(json.dumps({"seconds": PEERS[args.run](url, args.steps)}))
        return

    sys.path.insert(0, HERE)
    import _common

    _common.setup()
    from tasks_app.models import Tenant

    tenant = Tenant.objects.create(slug="bench", name="bench")
    names = [p for p in args.peers.split(",") if p]
    builds = {"runtime": _common.ROOT}
    if args.baseline:  # the same runtime workload on a worker running that ref's code
        from _common import export

        builds = {f"runtime@{args.baseline}": export(args.baseline), **builds}
    seconds: dict[str, list[float]] = {**{b: [] for b in builds}, **{p: [] for p in names}}
    try:
        for _ in range(args.rounds):
            for build, folder in builds.items():
                worker = _common.worker(None, cwd=folder)
                try:
                    runtime(20, tenant)  # warm-up: imports, connections
                    seconds[build].append(runtime(args.steps, tenant))
                finally:
                    worker.terminate()
                    worker.wait()
            for name in names:
                seconds[name].append(peer(args.peer_python, name, args.steps, os.environ["DATABASE_URL"]))
    finally:
        for folder in builds.values():
            if folder != _common.ROOT:
                shutil.rmtree(folder, ignore_errors=True)

    n = args.steps
    ms = {name: statistics.median(values) / n * 1000 for name, values in seconds.items()}
    print(
        f"N = {n} sequential no-op steps, each durable before the next; median of {args.rounds} interleaved "
        f"rounds; PostgreSQL + Redis on loopback"
    )
    print(f"{'system':14} {'ms/step':>9} {'rounds (ms/step)':>32} {'runtime / it':>13}")
    for name, value in ms.items():
        rounds = " ".join(f"{s / n * 1000:.2f}" for s in seconds[name])
        print(f"{name:14} {value:9.2f} {rounds:>32} {ms['runtime'] / value:13.2f}")
    print("targets: runtime <= 0.7 x dbos and <= 1.0 x langgraph per step")


if __name__ == "__main__":
    main()
