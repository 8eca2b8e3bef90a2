"""Kill: how long a running step takes to stop after an operator's kill (issue 18).

    .venv/bin/python bench/kill.py --kills 50

Two workers (prefork, -c 1) against PostgreSQL and Redis (a fresh bench database), with
the default lease (30 s) and heartbeat (10 s), so what stops the step is the kill's
doorbell, not a renewal. Each round starts a task whose one step POSTs to a local HTTP
server (tests/sink.py) that holds its answer for 10 minutes, waits until the call is in
flight, then accepts a kill (steering_app's do_enqueue_command, as the API does). Times,
from just before the kill is accepted:

    accepted   the command's transaction committed (the task is cancelled in it)
    stopped    the server saw the worker drop the connection (the step was cut)

Prints p50, p99 and max of each.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=50)
    args = parser.parse_args()
    os.environ.setdefault("SECURITY_HTTP_ALLOWLIST", "127.0.0.1")
    _common.setup(DATABASE_URL="postgres://postgres@127.0.0.1:5432/runtime_kill")

    import httpx

    from steering_app.actions import do_enqueue_command
    from steering_app.models import CommandType
    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.models import Task, Tenant

    tenant = Tenant.objects.create(slug="kill", name="kill")
    logs = Path(tempfile.mkdtemp(prefix="kill-"))
    port = _free_port()
    sink = subprocess.Popen(
        [sys.executable, str(_common.ROOT / "tests" / "sink.py"), "--port", str(port)], start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    workers = [_common.worker(logs / f"worker-{i}.log", "-l", "INFO") for i in range(2)]
    client = httpx.Client(timeout=5)
    accepted: list[float] = []
    stopped: list[float] = []
    try:
        _common.wait(lambda: _answers(client, url), timeout=30)
        for log in (logs / "worker-0.log", logs / "worker-1.log"):
            _common.wait(lambda log=log: b" ready." in log.read_bytes(), timeout=120, interval=0.05)
        for n in range(args.kills):
            before = client.get(f"{url}/stats").json()
            task, _ = do_create_task(
                console(tenant, "user:bench"),
                agent="tool_calls",
                input={
                    "calls": [
                        {
                            "tool": "http.request",
                            "args": {"url": f"{url}/effects?hang=600", "json": {"n": n}, "timeoutSeconds": 600},
                        }
                    ]
                },
            )
            _common.wait(
                lambda before=before: client.get(f"{url}/stats").json()["hanging"] > before["hanging"],
                timeout=60,
                interval=0.02,
            )
            version = Task.objects.values_list("state_version", flat=True).get(id=task.id)
            t0 = time.monotonic()
            do_enqueue_command(
                task.id,
                who=console(tenant, "user:bench"),
                command_id=f"kill-{n}",
                type=CommandType.KILL,
                payload={},
                expected_version=version,
                reason="bench",
            )
            accepted.append(time.monotonic() - t0)
            _common.wait(
                lambda before=before: client.get(f"{url}/stats").json()["dropped"] > before["dropped"],
                timeout=120,
                interval=0.002,
            )
            stopped.append(time.monotonic() - t0)
            assert Task.objects.get(id=task.id).status == "cancelled"
    finally:
        for proc in [*workers, sink]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    print(
        f"kill of a step stuck in a 10-minute HTTP call: 2 workers (-c 1), lease 30 s, heartbeat 10 s, "
        f"{len(stopped)} kills"
    )
    for name, times in (("accepted", accepted), ("stopped", stopped)):
        print(
            f"  {name:9s} p50 {statistics.median(times) * 1000:.0f} ms  "
            f"p99 {_common.percentile(times, 99) * 1000:.0f} ms  max {max(times) * 1000:.0f} ms"
        )
    print(f"  logs: {logs}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(client, url: str) -> bool:
    try:
        return client.get(f"{url}/stats").status_code == 200
    except Exception:  # noqa: BLE001 (not up yet)
        return False


if __name__ == "__main__":
    sys.exit(main())
