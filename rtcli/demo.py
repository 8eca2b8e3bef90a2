"""The whole story on the embedded default (no PostgreSQL, no Redis): `bin/run demo`.

Starts its own web, two workers and beat on SQLite and the filesystem broker under one
data folder, then, through the public API only (like any client): generates a corpus,
starts a review, watches it live, pauses and resumes it, kills the worker holding it
(SIGKILL) and watches the other one pick it up from its last checkpoint, approves the
publish step and prints where the report is.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from rtcli.cli import Progress
from rtcli.client import Client

ROOT = Path(__file__).resolve().parent.parent
# Short leases so the recovery shows in seconds (production uses 30 s).
KNOBS = {
    "RUNTIME_LEASE_SECONDS": "4",
    "RUNTIME_HEARTBEAT_SECONDS": "1",
    "RUNTIME_SCAN_SECONDS": "1",
    "RUNTIME_SLICE_STEPS": "4",
    "RUNTIME_DEPLOYMENT": "demo",
}


def chapter(text: str) -> None:
    print(f"\n== {text}", flush=True)


class Stack:
    """web + two workers + beat, each in its own process group, always stopped at the end."""

    def __init__(self, data: Path, port: int) -> None:
        self.data, self.port = data, port
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "RUNTIME_S3_BUCKET")}
        self.env = {**env, **KNOBS, "RUNTIME_DATA_DIR": str(data), "PYTHONUNBUFFERED": "1"}
        (data / "logs").mkdir(parents=True, exist_ok=True)

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=self.env, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise SystemExit(f"manage.py {' '.join(args)} failed:\n{done.stderr[-2000:]}")
        return done.stdout.strip()

    def start(self, name: str, *args: str) -> None:
        log = open(self.data / "logs" / f"{name}.log", "ab")  # noqa: SIM115 (lives as long as the process)
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", *args],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def up(self) -> None:
        self.start(
            "web",
            "uvicorn",
            "runtime_site.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
        )
        for name in ("worker-a", "worker-b"):
            self.start(
                name,
                "celery",
                "-A",
                "runtime_site",
                "worker",
                "-Q",
                "steps,maintenance",
                "-l",
                "WARNING",
                "--without-gossip",
                "--without-mingle",
                "-c",
                "1",
                "-n",
                f"{name}@%h",
            )
        self.start(
            "beat",
            "celery",
            "-A",
            "runtime_site",
            "beat",
            "-l",
            "WARNING",
            "-s",
            str(self.data / "celerybeat-schedule"),
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.procs["web"].poll() is not None:
                raise SystemExit(f"the web process did not come up; see {self.data / 'logs' / 'web.log'}")
            time.sleep(0.2)

    def kill_holder(self, owner: str) -> str | None:
        """SIGKILL the worker (its whole process group) whose pool child holds the lease."""
        pid = int(owner.rsplit(":", 1)[1])
        for name, proc in self.procs.items():
            if name.startswith("worker") and proc.poll() is None:
                try:
                    if os.getpgid(pid) == proc.pid:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait(timeout=30)
                        return name
                except ProcessLookupError:
                    return None
        return None

    def down(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def lease_owner(data: Path, task_id: str) -> str | None:
    """Who holds the task right now. Not in the public snapshot (an operator detail), so the
    demo peeks into the embedded database, read-only."""
    with sqlite3.connect(f"file:{data / 'runtime.sqlite3'}?mode=ro", uri=True, timeout=5) as db:
        row = db.execute("SELECT lease_owner FROM tasks_app_task WHERE id = ?", [task_id.replace("-", "")]).fetchone()
    return row[0] if row else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    data = Path(args.data).resolve()
    stack = Stack(data, args.port or free_port())
    chapter(f"Embedded default: SQLite, a filesystem broker and local blobs under {data}")
    stack.manage("migrate", "-v0")
    stack.manage("collectstatic", "--noinput", "-v0")  # as bin/run: the web process serves them (whitenoise)
    chapter(f"1. Generate a corpus of {args.count} contracts")
    print(
        stack.manage(
            "generate_corpus", "--prefix", "corpora/demo", "--count", str(args.count), "--seed", "42", "--if-missing"
        )
    )
    key = stack.manage("create_demo", "--key-only")
    stack.up()
    base = f"http://127.0.0.1:{stack.port}"
    print(f"web on {base} (dashboard: {base}/dashboard/ as demo/demo), two workers and beat are running")
    try:
        return story(Client(base, key), stack, data, args)
    finally:
        chapter("Stopping the demo's processes")
        stack.down()


def story(client: Client, stack: Stack, data: Path, args: argparse.Namespace) -> int:
    chapter("2. Start a document review (publishing the report needs an approval)")
    created = client.submit(
        "document_review",
        {"corpus": "corpora/demo", "batchSize": 20, "pacingMs": args.pacing, "publish": True},
        goal="Find risky contracts",
    )
    task_id = created["taskId"]
    print(f"task {task_id}\n  rt watch {task_id}   # the same view from another terminal (RT_URL, RT_API_KEY)")
    chapter("3. Watch it live (SSE)")
    bar = Progress(sys.stdout, sys.stdout.isatty())
    stage = "run"
    state: dict[str, Any] = {"status": "", "progress": 0.0, "phase": "", "message": "", "version": 0}
    for event in client.events(task_id):
        data_ = event.data
        if event.type == "task.snapshot":
            state.update(
                status=data_["runtimeStatus"],
                progress=data_["progress"],
                phase=data_["phase"],
                message=data_["statusMessage"],
                version=data_["stateVersion"],
            )
            if stage == "recovering" and data_["runtimeStatus"] == "working":
                bar.say(
                    f"   back to work on the surviving worker from checkpoint {data_['lastCheckpoint']} "
                    f"(recoveries: {data_['recoveries']}): only the steps after it run again"
                )
                stage = "recovered"
        elif event.type == "progress":
            state.update(
                progress=data_["progress"],
                phase=data_.get("phase") or state["phase"],
                message=data_.get("message") or "",
            )
        elif event.type == "steering.applied":
            state.update(status=data_["runtimeStatus"], version=data_["stateVersion"])
            if stage == "pausing" and data_["type"] == "pause":
                bar.say(f"   paused at a safe point, after a checkpoint ({round(state['progress'] * 100)}%)")
                chapter("5. Resume it")
                client.steer(task_id, "resume", {}, expected_version=data_["stateVersion"], command_id="demo-resume")
                stage = "resumed"
            elif data_["type"] == "resume":
                bar.say("   resumed from its last checkpoint")
        elif event.type == "checkpoint" and args.verbose:
            bar.say(f"   checkpoint #{data_['checkpoint']} ({data_['reason']})")
        elif event.type == "recovering":
            state["status"] = "recovering"
            bar.say(f"   {data_['reason']}: recovered, handed on to a surviving worker")
        elif event.type == "input_required":
            state["status"] = "input_required"
            chapter("7. Approve the publish step")
            bar.say(f"   the task asks: {data_['prompt']}")
            client.answer(task_id, data_["key"], "approve", reason="demo: looks right")
            bar.say("   approved")
        elif event.type == "terminal":
            state["status"] = data_["runtimeStatus"]
        bar.update(state["status"], state["progress"], state["phase"], state["message"])

        if stage == "run" and state["status"] == "working" and state["progress"] >= 0.15:
            chapter("4. Pause it")
            client.steer(
                task_id,
                "pause",
                {},
                expected_version=state["version"],
                command_id="demo-pause",
                reason="demo: a coffee break",
            )
            stage = "pausing"
        elif stage == "resumed" and state["status"] == "working" and state["progress"] >= 0.45:
            # Between slices nobody holds the task: look for a few seconds, else at the next event.
            deadline, owner = time.monotonic() + 5, None
            while owner is None and time.monotonic() < deadline:
                owner = lease_owner(data, task_id)
                if owner is None:
                    time.sleep(0.05)
            if owner and (victim := stack.kill_holder(owner)):
                chapter(f"6. Kill the worker holding the task ({victim}, {owner}) with SIGKILL")
                stage = "recovering"

    if stage not in ("recovering", "recovered"):
        print("(the task ended before a worker could be killed mid-slice; try a larger --count)")
    result = client.result(task_id)
    chapter(f"8. {result['runtimeStatus']}")
    outcome = result.get("result") or {}
    if outcome:
        levels = outcome.get("byLevel", {})
        print(
            f"{outcome['documentsReviewed']} contracts reviewed: "
            + ", ".join(f"{n} {level}" for level, n in levels.items())
        )
        for label, ref in (
            ("report", (outcome.get("report") or {}).get("markdown")),
            ("published", (outcome.get("published") or {}).get("ref")),
        ):
            if ref:
                path = data / "blobs" / ref.removeprefix("file://")
                print(f"{label}: {ref}" + (f"\n  on disk: {path}" if path.exists() else ""))
    snapshot = client.snapshot(task_id)
    print(f"recoveries: {snapshot['recoveries']}; audit trail: GET /runtime/tasks/{task_id}/audit")
    return 0 if result["runtimeStatus"] == "completed" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bin/run demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", default=str(ROOT / "var" / "demo"), help="data folder (default var/demo)")
    parser.add_argument("--port", type=int, default=0, help="web port (default: a free one)")
    parser.add_argument("--count", type=int, default=600, help="contracts in the corpus (default 600)")
    parser.add_argument("--pacing", type=int, default=300, help="ms per batch of 20, to have a run to watch")
    parser.add_argument("--verbose", action="store_true", help="also show every checkpoint")
    # Stopped by a signal (a closed terminal, a test's deadline), it stops its processes too
    # (run's finally) instead of leaving web, workers and beat running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
