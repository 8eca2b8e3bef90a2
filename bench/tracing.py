"""What tracing costs per step: the same no-op task on a worker with tracing off and on.

    .venv/bin/python bench/tracing.py --steps 500 --repeat 3

One real worker process (prefork, -c 1) at a time against PostgreSQL and Redis; off and
on alternate, in the same run. "On" exports every span over OTLP/HTTP to a receiver in
this process that reads and drops the bodies (a collector stand-in that costs the worker
nothing). Reported: wall ms per step off and on, the worker's CPU ms per step (its main and
pool processes, read from /proc: far less sensitive than wall time to other load on the
machine), the differences per step, and the spans the worker exported per step (step,
slice and Celery spans, and one per SQL statement).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import _common

bodies: list[bytes] = []  # decoded after the run, off the clock


class Drop(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        bodies.append(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def run(n: int, tenant) -> float:
    """Seconds from task creation to completion for an n-step no-op task."""
    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.models import Task

    start = time.time()
    task, _ = do_create_task(
        console(tenant, "user:bench"), agent="noop", input={"steps": n}, checkpoint_policy={"everySteps": 10}
    )
    _common.wait(lambda: Task.objects.filter(id=task.id, status="completed").exists())
    task.refresh_from_db()
    return task.finished_at.timestamp() - start


def cpu_seconds(group: int) -> float:
    """User + system CPU of every process in the worker's process group."""
    total = 0
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                with open(f"/proc/{stat}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group:  # pgrp
                total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def spans() -> int:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    return sum(
        len(scope.spans)
        for body in bodies
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans
        for scope in rs.scope_spans
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    _common.setup()
    from tasks_app.models import Tenant

    server = ThreadingHTTPServer(("127.0.0.1", 0), Drop)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    tenant = Tenant.objects.create(slug="bench", name="bench")
    times: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    settings = {"off": {}, "on": {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}}
    for _ in range(args.repeat):
        for mode in ("off", "on"):
            worker = _common.worker(None, **settings[mode])
            try:
                run(20, tenant)  # warm-up: imports, connections, the exporter
                before = cpu_seconds(worker.pid)
                times[mode].append(run(args.steps, tenant))
                cpu[mode].append(cpu_seconds(worker.pid) - before)
            finally:
                worker.terminate()
                worker.wait()
    n = args.steps
    off, on = (statistics.median(times[m]) / n * 1000 for m in ("off", "on"))
    print(
        f"N = {n} steps per task, median of {args.repeat} (off and on alternating); one worker (-c 1); "
        "PostgreSQL + Redis on loopback"
    )
    cpu_off, cpu_on = (statistics.median(cpu[m]) / n * 1000 for m in ("off", "on"))
    print(f"{'tracing':10} {'ms/step':>9} {'steps/s':>9} {'worker CPU ms/step':>19}")
    for label, ms, cpu_ms in (("off", off, cpu_off), ("on", on, cpu_on)):
        print(f"{label:10} {ms:9.3f} {1000 / ms:9.0f} {cpu_ms:19.3f}")
    steps = (n + 20) * args.repeat  # with the warm-up tasks
    print(
        f"overhead: wall {on - off:+.3f} ms per step ({(on / off - 1) * 100:+.1f} %), worker CPU "
        f"{cpu_on - cpu_off:+.3f} ms per step ({(cpu_on / cpu_off - 1) * 100:+.1f} %); the worker exported "
        f"{spans() / steps:.1f} spans and {sum(map(len, bodies)) / steps:.0f} bytes of OTLP per step"
    )


if __name__ == "__main__":
    main()
