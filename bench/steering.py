"""Steering latency against a running task, over real HTTP.

    .venv/bin/python bench/steering.py --commands 200

One uvicorn web process, one worker (-c 1) running a long no-op task (20 ms steps), on
PostgreSQL and Redis. Measures (1) accept latency: the HTTP round trip of a command that
is accepted (set_priority, which also applies at once), p50/p99; (2) accept → applied:
for pause commands, which a worker applies at its next safe point, the time from the
command's acceptance (created_at) to its steering.applied (applied_at), p50/p99; each
pause is followed by a resume. Baseline in the same run: the round trip of GET /healthz
(no database) and of GET /runtime/tasks/{id} (the snapshot read).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import _common


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commands", type=int, default=200)
    parser.add_argument("--pauses", type=int, default=50)
    args = parser.parse_args()
    _common.setup(RUNTIME_SLICE_STEPS="50")
    import httpx

    from steering_app.models import SteeringCommand
    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.models import Task

    tenant, token = _common.operator_key()
    logs = Path(tempfile.mkdtemp(prefix="bench-steering-"))
    web, base = _common.web(logs)
    worker = _common.worker(logs / "worker.log")
    http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"})
    try:
        task, _ = do_create_task(console(tenant, "user:bench"), agent="noop", input={"steps": 1_000_000, "sleepMs": 20})
        _common.wait(lambda: Task.objects.get(id=task.id).steps_done > 0, timeout=30)
        url = f"/runtime/tasks/{task.id}"

        def timed(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1000

        health = [timed(lambda: http.get("/healthz")) for _ in range(args.commands)]
        reads = [timed(lambda: http.get(url)) for _ in range(args.commands)]
        accepts = []
        for i in range(args.commands):
            version = http.get(url).json()["stateVersion"]
            body = {
                "commandId": f"p{i}",
                "type": "set_priority",
                "payload": {"priority": i % 10},
                "expectedVersion": version,
            }
            t0 = time.perf_counter()
            response = http.post(f"{url}/steering", json=body)
            accepts.append((time.perf_counter() - t0) * 1000)
            assert response.status_code == 202, response.text
        applied = []
        for i in range(args.pauses):
            version = http.get(url).json()["stateVersion"]
            response = http.post(
                f"{url}/steering", json={"commandId": f"pause{i}", "type": "pause", "expectedVersion": version}
            )
            assert response.status_code == 202, response.text
            _common.wait(lambda: Task.objects.get(id=task.id).status == "paused", timeout=30, interval=0.002)
            command = SteeringCommand.objects.get(task=task, command_id=f"pause{i}")
            applied.append((command.applied_at - command.created_at).total_seconds() * 1000)
            version = http.get(url).json()["stateVersion"]
            http.post(f"{url}/steering", json={"commandId": f"resume{i}", "type": "resume", "expectedVersion": version})
            _common.wait(lambda: Task.objects.get(id=task.id).status == "working", timeout=30, interval=0.002)
            before = Task.objects.get(id=task.id).steps_done  # let the resumed slice take a few steps first
            _common.wait(lambda before=before: Task.objects.get(id=task.id).steps_done >= before + 2, timeout=30)
    finally:
        for proc in (web, worker):
            proc.terminate()
            proc.wait()

    def row(label: str, values: list[float]) -> str:
        return (
            f"{label:44} p50 {statistics.median(values):7.2f} ms   p99 {_common.percentile(values, 99):7.2f} ms"
            f"   (n={len(values)})"
        )

    print("steering latency; one uvicorn process, one worker (-c 1), a running no-op task with 20 ms steps")
    print(row("baseline: GET /healthz", health))
    print(row("baseline: GET /runtime/tasks/{id} (snapshot)", reads))
    print(row("accept: POST .../steering set_priority", accepts))
    print(row("accept -> steering.applied (pause)", applied))
    print(f"accept p50 / snapshot-read p50 = {statistics.median(accepts) / statistics.median(reads):.2f}")


if __name__ == "__main__":
    main()
