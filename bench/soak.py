"""Fault-injection soak (issue 12): tasks must survive SIGKILLs, freezes, database and broker
faults and rolling restarts, with every external effect exactly once. Not a CI test.

    .venv/bin/python bench/soak.py                 # 200 SIGKILLs, 20 freezes, 10 DB terminations, ...
    .venv/bin/python bench/soak.py --quick         # a 2-3 minute smoke of the same

Real processes on a database of its own (created and migrated here, dropped at the end) and
a private redis-server on a free port (the broker of every process here, so restarting it
disturbs nobody): --workers Celery workers (conftest's WORKER command), beat, uvicorn, and
tests/sink.py, the independent receiver that counts the effects per idempotency key.

Workload, submitted through the REST API (with an Idempotency-Key, so a failed POST is
retried safely) and topped up while faults remain: `webhook` and `tool_calls` tasks whose
steps POST to the sink through the ledger, and step-heavy `noop` tasks.

Faults, spaced --gap seconds apart in a shuffled plan:
  SIGKILL   a worker's process group (one holding a lease when there is one), replaced at
            once; a quarter of them are aimed at a task that is re-running steps it had
            committed before its last crash (the same step range, killed again)
  freeze    SIGSTOP a lease holder's group for longer than the lease, then SIGCONT
  database  pg_terminate_backend of every backend of the soak's database but this one,
            while a step runs (one that calls out, when there is one)
  Redis     kill the private redis-server, leave it down --redis-outage s, start it empty
  SIGTERM   a worker's main process (what a deploy sends), replaced once it exits

Watched all along: each task's stepsDone/progress in the database (every tick) and through
GET /runtime/tasks (every --api-poll s); any decrease is recorded, as is any 5xx answer.

Promises checked at the end (exit status 1 if any fails): every task completes; no effect
is duplicated (a second POST with one key, or a key the task never should have made) or
missing; no task failed or was dead-lettered (every fault here is infrastructure); no
snapshot went backwards; the API never answered a 5xx other than 503; every fault asked for
was injected. Also printed: recoveries, what the logs say, and takeover times (from the
signal to the next step of a held task committed by another worker), p50/p99, for SIGKILL,
SIGTERM and freezes; every signal and its takeovers are listed in signals.txt in the logs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import _common
import chaos

# chaos.py's timings (lease 3 s, heartbeat 1 s, scan 1 s, stall 10 s, 20-step slices), so the
# two benches' takeover figures compare; recoveries are not limited: a task hit by many random
# kills is not a poison task, and the soak is about surviving them.
SETTINGS = {
    **chaos.SETTINGS,
    "RUNTIME_MAX_RECOVERIES": "1000",
    "SECURITY_HTTP_ALLOWLIST": "127.0.0.1",
    "PYTHONUNBUFFERED": "1",
}
SETTLED = ("completed", "failed", "cancelled", "dead_lettered", "input_required")
OPEN = "queued,working,pausing,paused,input_required,recovering"
FULL = {"kills": 200, "freezes": 20, "db_terminations": 10, "sigterms": 20, "redis_restarts": 1, "tasks": 40}
QUICK = {"kills": 30, "freezes": 3, "db_terminations": 3, "sigterms": 4, "redis_restarts": 1, "tasks": 8}
HOST = socket.gethostname()
Row = tuple[str, int, float, str | None]  # a task's status, steps_done, progress, owner of its live lease


def group_identities(pgid: int) -> set[str]:
    """Worker identities (engine.worker_identity: host:pid) of every process in a group."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            found.add(f"{HOST}:{stat.parent.name}")
    return found


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    log: Path
    frozen_until: float | None = None  # SIGSTOPped until then (monotonic)
    stopping_since: float | None = None  # SIGTERM sent then (monotonic)
    started: bool = False  # its log said " ready." (consuming, its pool up)

    @property
    def usable(self) -> bool:
        return self.frozen_until is None and self.stopping_since is None and self.proc.poll() is None

    @property
    def ready(self) -> bool:
        if not self.started:
            with contextlib.suppress(OSError):
                self.started = b" ready." in self.log.read_bytes()
        return self.started and self.usable


@dataclass
class Signalled:
    """A worker that was killed, told to stop or frozen, and the tasks it held at that moment."""

    how: str  # SIGKILL, SIGTERM or SIGSTOP (a freeze)
    at: datetime
    identities: set[str]
    held: list[str]
    spare: int = 0  # ready workers holding no lease at that moment, but the one signalled


@dataclass
class Rerun:
    """A task whose worker was killed after committing steps past its checkpoint: killed
    again while it re-runs them (below `high`, committed after `since`)."""

    high: int
    since: datetime
    depth: int
    expires: float


@dataclass
class Figures:
    kills: int = 0
    same_range_kills: int = 0
    freezes: int = 0
    db_terminations: int = 0
    backends_terminated: int = 0
    redis_restarts: int = 0
    sigterms: int = 0
    sigterms_forced: int = 0  # still running --sigterm-grace s after SIGTERM: SIGKILLed
    unexpected_exits: Counter[str] = field(default_factory=Counter)
    signalled: list[Signalled] = field(default_factory=list)
    backwards: list[str] = field(default_factory=list)
    db_polls: int = 0
    api_polls: int = 0
    api_5xx: Counter[int] = field(default_factory=Counter)
    api_transport_errors: int = 0


class Soak:
    def __init__(self, args: argparse.Namespace, logs: Path, db_name: str) -> None:
        self.args, self.logs, self.db_name = args, logs, db_name
        self.rng = random.Random(args.seed)
        self.figures = Figures()
        self.tasks: dict[str, dict[str, Any]] = {}  # id → {"kind", "effects": expected keys' count}
        self.pending_create: tuple[str, dict[str, Any]] | None = None  # a POST to retry with its key
        self.submitted = 0
        self.seen_db: dict[str, tuple[int, float]] = {}
        self.seen_api: dict[str, tuple[int, float]] = {}
        self.reruns: dict[str, Rerun] = {}
        self.workers: list[Worker] = []
        self.generation = 0
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    # --- processes ----------------------------------------------------------------------

    def start_redis(self) -> None:
        self.procs["redis"] = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(self.args.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.logs),
            ],
            stdout=open(self.logs / "redis.log", "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        import redis

        client = redis.Redis(port=self.args.redis_port, socket_connect_timeout=1)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        _common.wait(up, timeout=30, interval=0.05)

    def start_worker(self) -> Worker:
        from conftest import WORKER

        self.generation += 1
        log = self.logs / f"worker-{self.generation}.log"
        return Worker(_common.start([*WORKER, str(self.args.concurrency)], log), log)

    def start_beat(self) -> None:
        from conftest import BEAT

        self.procs["beat"] = _common.start([*BEAT, str(self.logs / "beat-schedule")], self.logs / "beat.log")

    def start_web(self) -> None:
        self.procs["web"], self.base = _common.web(self.logs)

    def stop_all(self) -> None:
        for proc in [*(w.proc for w in self.workers), *self.procs.values()]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def replace_the_dead(self) -> None:
        """Workers that exited are replaced (a SIGTERMed one once it is gone, or SIGKILLed
        after --sigterm-grace); so are beat and web. Exits nobody asked for are counted."""
        now = time.monotonic()
        for i, worker in enumerate(self.workers):
            if worker.frozen_until is not None and now >= worker.frozen_until:
                os.killpg(worker.proc.pid, signal.SIGCONT)
                worker.frozen_until = None
            if (
                worker.stopping_since is not None
                and worker.proc.poll() is None
                and now - worker.stopping_since > self.args.sigterm_grace
            ):
                self.figures.sigterms_forced += 1
                os.killpg(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()
            if worker.proc.poll() is not None:
                if worker.stopping_since is None:
                    self.figures.unexpected_exits["worker"] += 1
                else:  # its pool children may still be finishing: the group goes with it
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(worker.proc.pid, signal.SIGKILL)
                self.workers[i] = self.start_worker()
        for name, start in (("beat", self.start_beat), ("web", self.start_web)):
            if self.procs[name].poll() is not None:
                self.figures.unexpected_exits[name] += 1
                start()

    # --- workload -----------------------------------------------------------------------

    def body(self, n: int) -> tuple[dict[str, Any], int]:
        """The n-th task (POST body) and how many effects it must have at the sink."""
        sink = self.sink
        kind = ("webhook", "noop", "tool_calls", "noop")[n % 4]
        if kind == "webhook":
            return {
                "agent": "webhook",
                "checkpointPolicy": {"everySteps": 5},
                "input": {
                    "url": f"{sink}/effects",
                    "reconcileUrl": f"{sink}/effects/{{key}}",
                    "payload": {"task": n},
                    "count": 25,
                    "sleepMs": 100,
                },
            }, 25
        if kind == "tool_calls":
            calls = [
                {
                    "tool": "http.request",
                    "args": {
                        "url": f"{sink}/effects",
                        "json": {"task": n, "call": i},
                        "reconcileUrl": f"{sink}/effects/{{key}}",
                    },
                }
                for i in range(20)
            ]
            return {"agent": "tool_calls", "checkpointPolicy": {"everySteps": 5}, "input": {"calls": calls}}, 20
        # Checkpoints only at slice ends (every 20 steps): a crash leaves up to 19 committed
        # steps to re-run, the range a second kill aims at.
        return {"agent": "noop", "checkpointPolicy": {"everySteps": 50}, "input": {"steps": 200, "sleepMs": 80}}, 0

    def top_up(self, faults_left: bool) -> None:
        """Keep --in-flight tasks moving while faults remain or fewer than --tasks were submitted
        (a task with no new step for --stuck-after s no longer counts: it stalls or loops)."""
        import httpx

        now = time.monotonic()
        open_now = sum(
            1 for t in self.tasks.values() if not t.get("settled") and now - t["moved"] < self.args.stuck_after
        )
        if self.pending_create is None:
            if open_now >= self.args.in_flight or not (faults_left or self.submitted < self.args.tasks):
                return
            body, effects = self.body(self.submitted)
            self.pending_create = (f"soak-{self.submitted}", {"body": body, "effects": effects})
            self.submitted += 1
        key, spec = self.pending_create
        try:
            response = self.api.post("/runtime/tasks", json=spec["body"], headers={"Idempotency-Key": key})
        except httpx.TransportError:
            self.figures.api_transport_errors += 1
            return
        if response.status_code >= 500:
            self.figures.api_5xx[response.status_code] += 1
            return
        if response.status_code not in (200, 201):
            raise SystemExit(f"the soak's own request was refused: {response.status_code} {response.text}")
        self.tasks[response.json()["taskId"]] = {
            "kind": spec["body"]["agent"],
            "effects": spec["effects"],
            "moved": time.monotonic(),
        }
        self.pending_create = None

    # --- watching -----------------------------------------------------------------------

    def note(self, source: str, seen: dict[str, tuple[int, float]], task_id: str, steps: int, progress: float) -> None:
        """Record a snapshot that moved backwards (stepsDone or progress below the previous look)."""
        last = seen.get(task_id, (0, 0.0))
        if steps < last[0] or progress < last[1] - 1e-9:
            self.figures.backwards.append(
                f"{source} {task_id}: stepsDone {last[0]}→{steps}, progress {last[1]:.3f}→{progress:.3f}"
            )
        seen[task_id] = (steps, progress)

    def open_rows(self) -> dict[str, Row]:
        """id → Row of every task not yet settled. An expired lease has no owner: a slice that
        crashed on an error leaves its worker's name behind, but holds nothing."""
        from django.utils import timezone

        from tasks_app.models import Task

        ids = [i for i, t in self.tasks.items() if not t.get("settled")]
        now = timezone.now()
        return {
            str(task_id): (status, steps, progress, owner if expires and expires > now else None)
            for task_id, status, steps, progress, owner, expires in Task.objects.filter(id__in=ids).values_list(
                "id", "status", "steps_done", "progress", "lease_owner", "lease_expires_at"
            )
        }

    def watch_db(self) -> dict[str, Row]:
        rows = self.open_rows()
        self.figures.db_polls += 1
        for task_id, (status, steps, progress, _) in rows.items():
            if steps > self.tasks[task_id].get("high", 0):  # a new step, not one re-run
                self.tasks[task_id].update(high=steps, moved=time.monotonic())
            self.note("db", self.seen_db, task_id, steps, progress)
            if status in SETTLED:
                self.tasks[task_id]["settled"] = status
        return rows

    def watch_api(self) -> None:
        """The snapshots a client sees, through GET /runtime/tasks (open tasks only)."""
        import httpx

        try:
            response = self.api.get("/runtime/tasks", params={"status": OPEN, "limit": 200})
        except httpx.TransportError:
            self.figures.api_transport_errors += 1
            return
        self.figures.api_polls += 1
        if response.status_code >= 500:
            self.figures.api_5xx[response.status_code] += 1
            return
        for snap in response.json()["results"]:
            self.note("api", self.seen_api, snap["taskId"], snap["stepsDone"], snap["progress"])

    # --- faults -------------------------------------------------------------------------

    def holders(self, rows: dict[str, Row]) -> dict[int, list[str]]:
        """Usable worker index → ids of the tasks its processes hold a lease on."""
        held: dict[int, list[str]] = {}
        for i, worker in enumerate(self.workers):
            if worker.usable:
                identities = group_identities(worker.proc.pid)
                held[i] = [t for t, row in rows.items() if row[3] in identities]
        return held

    def spare(self, rows: dict[str, Row], but: int) -> int:
        """Ready workers (but worker `but`) whose processes hold no lease: what can take a
        task over at once."""
        owners = {row[3] for row in rows.values() if row[3]}
        return sum(
            1
            for j, worker in enumerate(self.workers)
            if j != but and worker.ready and not owners & group_identities(worker.proc.pid)
        )

    def victim(self, rows: dict[str, Row]) -> int | None:
        """A usable worker, one holding a lease when there is one (a fault mid-step)."""
        held = self.holders(rows)
        busy = [i for i, tasks in held.items() if tasks]
        return self.rng.choice(busy or list(held)) if held else None

    def signal_worker(self, i: int, how: str, rows: dict[str, Row], depth: int = 0) -> None:
        """SIGKILL a worker's group (replaced at once) or SIGTERM its main process. A task it
        held with committed steps past its checkpoint becomes a target for aim_at_reruns."""
        from django.utils import timezone

        from checkpoints_app.models import Checkpoint

        worker = self.workers[i]
        identities = group_identities(worker.proc.pid)
        rows = {**rows, **self.open_rows()}  # the lease holders of this very moment
        held = [t for t, row in rows.items() if row[3] in identities]
        spare = self.spare(rows, but=i)
        if how == "SIGKILL":
            os.killpg(worker.proc.pid, signal.SIGKILL)
            worker.proc.wait()
            self.figures.kills += 1
            self.figures.same_range_kills += int(depth > 0)
            self.workers[i] = self.start_worker()
        else:
            os.kill(worker.proc.pid, signal.SIGTERM)  # the main process only, as a deploy does
            worker.stopping_since = time.monotonic()
            self.figures.sigterms += 1
        at = timezone.now()
        self.figures.signalled.append(Signalled(how, at, identities, held, spare))
        if how != "SIGKILL":
            return
        for task_id in held:
            steps = rows[task_id][1]
            checkpoint = (
                Checkpoint.objects.filter(task_id=task_id)
                .order_by("-sequence")
                .values_list("sequence", flat=True)
                .first()
                or 0
            )
            previous = self.reruns.pop(task_id, None)
            high = max(steps, previous.high if previous else 0)
            if depth < self.args.rekill_depth and high - checkpoint >= 3:
                self.reruns[task_id] = Rerun(high, at, depth + 1, time.monotonic() + 60)

    def aim_at_reruns(self, rows: dict[str, Row]) -> bool:
        """Kill the worker of a task that is re-running, below its high-water mark, steps it
        committed before a crash. True if one was killed."""
        from tasks_app.models import Step

        now = time.monotonic()
        for task_id, rerun in list(self.reruns.items()):
            row = rows.get(task_id)
            if now > rerun.expires or row is None or row[0] in SETTLED:
                del self.reruns[task_id]
                continue
            if (
                row[3] is None
                or not Step.objects.filter(
                    task_id=task_id, finished_at__gt=rerun.since, sequence__lt=rerun.high - 1
                ).exists()
            ):
                continue
            for i, worker in enumerate(self.workers):
                if worker.usable and row[3] in group_identities(worker.proc.pid):
                    self.signal_worker(i, "SIGKILL", rows, depth=rerun.depth)
                    return True
        return False

    def freeze(self, i: int, rows: dict[str, Row]) -> None:
        from django.utils import timezone

        worker = self.workers[i]
        identities = group_identities(worker.proc.pid)
        spare = self.spare(rows, but=i)
        os.killpg(worker.proc.pid, signal.SIGSTOP)
        worker.frozen_until = time.monotonic() + self.args.freeze_seconds
        self.figures.freezes += 1
        self.figures.signalled.append(
            Signalled(
                "SIGSTOP", timezone.now(), identities, [t for t, row in rows.items() if row[3] in identities], spare
            )
        )

    def terminate_backends(self) -> None:
        from django.db import connection

        with connection.cursor() as cursor:  # this database only, never the shared server
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            self.figures.backends_terminated += cursor.fetchone()[0]
        self.figures.db_terminations += 1

    def restart_redis(self) -> None:
        redis = self.procs["redis"]
        os.killpg(redis.pid, signal.SIGKILL)  # every queued and in-flight message is gone with it
        redis.wait()
        time.sleep(self.args.redis_outage)  # the outage is the fault being injected, not a wait
        self.start_redis()
        self.figures.redis_restarts += 1

    def inject(self, fault: str, rows: dict[str, Row], patient: bool) -> bool:
        """False: not now (no worker to hit, a freeze still on, nothing mid-step): try later."""
        mid_step = any(row[3] for row in rows.values())
        if fault == "redis":
            self.restart_redis()
            return True
        if fault == "database":
            # Best while a step that calls out holds a lease: its ledger reads and writes are
            # inside the step (a no-op step only meets the dead connection at its commit).
            calling = any(row[3] and self.tasks[t]["effects"] for t, row in rows.items())
            if not (calling or (mid_step and not patient)):
                return False
            self.terminate_backends()
            return True
        if fault == "freeze" and any(w.frozen_until for w in self.workers):
            return False
        if fault == "SIGTERM" and not all(w.ready for w in self.workers):
            # A rolling restart stops the next worker once the last one's replacement is
            # ready (a readiness probe, maxUnavailable): stopping one while another is
            # still booting (2-4 s of imports on a busy machine) leaves no spare worker, and
            # the takeover would time the queue behind busy workers, not the handover.
            return False
        i = self.victim(rows)
        if i is None or (fault == "freeze" and not mid_step):
            return False
        if fault == "SIGTERM" and patient and not self.spare(rows, but=i):
            # Every worker busy (tasks re-running after kills are topped up beyond
            # --in-flight): the takeover would wait for another task's slice to end. Wait
            # for a spare worker a while (listed as "no spare" if it never comes).
            return False
        if fault == "freeze":
            self.freeze(i, rows)
        else:
            self.signal_worker(i, fault, rows)
        return True

    # --- the run ------------------------------------------------------------------------

    def plan(self) -> list[str]:
        a = self.args
        self.rekills_left = a.kills // 4
        plan = (
            ["SIGKILL"] * (a.kills - self.rekills_left)
            + ["freeze"] * a.freezes
            + ["database"] * a.db_terminations
            + ["SIGTERM"] * a.sigterms
        )
        self.rng.shuffle(plan)
        for _ in range(a.redis_restarts):  # in the middle of the run, with work under way
            plan.insert(self.rng.randrange(len(plan) // 3, 2 * len(plan) // 3 + 1), "redis")
        return plan

    def run(self) -> float:
        import httpx

        self.start_redis()
        sink_port = _common.free_port()
        self.procs["sink"] = _common.start(["tests.sink", "--port", str(sink_port)], self.logs / "sink.log")
        self.sink = f"http://127.0.0.1:{sink_port}"
        _common.wait(lambda: _answers(f"{self.sink}/stats"), timeout=30, interval=0.1)
        _, token = _common.operator_key()
        self.start_web()
        self.api = httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        self.start_beat()
        self.workers = [self.start_worker() for _ in range(self.args.workers)]

        plan = self.plan()
        low, high = (float(x) for x in self.args.gap.split(":"))
        started = time.monotonic()
        next_fault = started + self.args.warmup
        next_api = started
        drain_from: float | None = None
        deferred = 0  # looks at the next fault that found no moment for it yet
        while True:
            now = time.monotonic()
            rows = self.watch_db()
            if self.rekills_left and self.aim_at_reruns(rows):
                self.rekills_left -= 1
            if not plan and self.rekills_left:  # no task offered its range again: plain kills
                plan, self.rekills_left = ["SIGKILL"] * self.rekills_left, 0
            if plan and now >= next_fault:
                if self.inject(plan[0], rows, patient=deferred < 50):
                    plan.pop(0)
                    next_fault, deferred = now + self.rng.uniform(low, high), 0
                else:
                    next_fault, deferred = now + 0.2, deferred + 1
            self.replace_the_dead()
            faults_left = bool(plan) or any(w.frozen_until or w.stopping_since for w in self.workers)
            self.top_up(faults_left)
            if now >= next_api:
                self.watch_api()
                next_api = now + self.args.api_poll
            if faults_left:
                if now - started > self.args.timeout:
                    print(f"TIMEOUT with {len(plan)} faults not injected")
                    break
            else:
                drain_from = drain_from or now
                if all(t.get("settled") for t in self.tasks.values()) and self.pending_create is None:
                    break
                if now - drain_from > self.args.drain_timeout:
                    print(
                        f"DRAIN TIMEOUT: {sum(not t.get('settled') for t in self.tasks.values())} tasks unsettled "
                        f"{self.args.drain_timeout:g}s after the last fault"
                    )
                    break
            time.sleep(self.args.tick)
        self.watch_db()
        self.faults_seconds = (drain_from or time.monotonic()) - started
        return time.monotonic() - started


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.TransportError:
        return False


def takeovers(signalled: list[Signalled], logs: Path) -> dict[str, list[float]]:
    """Seconds from the signal to the next step of each held task committed by another
    worker, by signal; every signal and its takeovers also go to signals.txt in the logs."""
    from tasks_app.models import Step

    times: dict[str, list[float]] = {"SIGKILL": [], "SIGTERM": [], "SIGSTOP": []}
    with open(logs / "signals.txt", "w") as out:
        for s in signalled:
            taken = {}
            for task_id in s.held:
                first = (
                    Step.objects.filter(task_id=task_id, finished_at__gt=s.at)
                    .exclude(worker__in=s.identities)
                    .order_by("finished_at")
                    .values_list("finished_at", flat=True)
                    .first()
                )
                taken[task_id] = None if first is None else (first - s.at).total_seconds()
                if first is not None:
                    times[s.how].append(taken[task_id])
            out.write(f"{s.at.isoformat()} {s.how} {sorted(s.identities)} spare {s.spare} held {taken}\n")
    return times


def log_counts(logs: Path) -> Counter[str]:
    """What the processes' logs say happened (diagnosis, not a promise)."""
    patterns = {
        "slice raised {}": re.compile(r"run_task_slice\[[^]]*\] raised unexpected: (\w+)"),
        "step failed in the engine": re.compile(r"tasks_app\.engine task \S+: step \S+ failed"),
        "lease lost": re.compile(r"lease lost, slice abandoned|lease on task \S+ lost"),
        # "worker lost (lease of host:pid expired), now ..." (before: "worker lost, now ...")
        "recovered by the reaper": re.compile(r"worker lost(?: \([^)]*\))?, now recovering"),
        "dead-lettered by the reaper": re.compile(r"worker lost(?: \([^)]*\))?, now dead_lettered"),
        "lease expired across a database restart": re.compile(r"expired across a restart of the database"),
    }
    counts: Counter[str] = Counter()
    for log in logs.glob("*.log"):
        text = log.read_text(errors="replace")
        for label, pattern in patterns.items():
            for match in pattern.finditer(text):
                counts[label.format(*match.groups())] += 1
    return counts


def report(soak: Soak, elapsed: float) -> bool:
    """Print the figures and the promises; True if every promise held."""
    import httpx

    from tasks_app.models import Task

    a, f = soak.args, soak.figures
    tasks = {str(t.id): t for t in Task.objects.filter(id__in=list(soak.tasks))}
    by_status = Counter(t.status for t in tasks.values())
    stats = httpx.get(f"{soak.sink}/stats", timeout=10).json()
    per_key: dict[str, int] = stats["perKey"]
    resent = sum(n - 1 for n in per_key.values() if n > 1)
    unexpected = missing = expected = 0
    for task_id, spec in soak.tasks.items():
        if not spec["effects"]:
            continue
        want = {f"{task_id}:{seq}:1" for seq in range(1, spec["effects"] + 1)}
        got = {k for k in per_key if k.startswith(task_id + ":")}
        unexpected += len(got - want)
        if tasks[task_id].status == "completed":
            expected += len(want)
            missing += len(want - got)
    broken = [t for t in tasks.values() if t.status in ("failed", "dead_lettered")]
    reasons = Counter(
        f"{t.status}: {(t.error or {}).get('code', '')} {(t.error or {}).get('message', '')[:90]}" for t in broken
    )
    taken = takeovers(f.signalled, soak.logs)

    env = os.environ
    print(
        f"soak: {a.workers} workers (-c {a.concurrency}), beat, uvicorn, sink, private redis :{a.redis_port}, "
        f"database {soak.db_name}; lease {env['RUNTIME_LEASE_SECONDS']}s, heartbeat "
        f"{env['RUNTIME_HEARTBEAT_SECONDS']}s, scan {env['RUNTIME_SCAN_SECONDS']}s, stall "
        f"{env['RUNTIME_STALL_SECONDS']}s, slices of {env['RUNTIME_SLICE_STEPS']} steps, "
        f"max recoveries {env['RUNTIME_MAX_RECOVERIES']}, seed {a.seed}"
    )
    print(f"  ran {elapsed:.0f}s (faults {soak.faults_seconds:.0f}s, then drain)")
    print(
        f"  faults: SIGKILL {f.kills} ({f.same_range_kills} again in a step range being re-run), "
        f"freezes {f.freezes} ({a.freeze_seconds:g}s each), database terminations {f.db_terminations} "
        f"({f.backends_terminated} backends), Redis restarts {f.redis_restarts}, SIGTERM restarts {f.sigterms} "
        f"({f.sigterms_forced} still running after {a.sigterm_grace:g}s: SIGKILLed); "
        f"unexpected exits {dict(f.unexpected_exits) or 0}"
    )
    print(
        f"  tasks: {len(soak.tasks)} ({dict(Counter(s['kind'] for s in soak.tasks.values()))}); "
        f"by status {dict(by_status)}; steps {sum(t.steps_done for t in tasks.values())}; "
        f"recoveries {sum(t.recoveries for t in tasks.values())} "
        f"(at most {max((t.recoveries for t in tasks.values()), default=0)} for one task)"
    )
    for reason, n in reasons.most_common(8):
        print(f"    {n} x {reason}")
    print(
        f"  effects at the receiver: {stats['effects']} ({stats['posts']} POSTs); expected of completed "
        f"tasks {expected}; duplicated {resent + unexpected} ({resent} re-sent with one key, {unexpected} "
        f"under keys never due); missing {missing}"
    )
    print(
        f"  snapshot moved backwards: {len(f.backwards)} times ({f.db_polls} database polls, {f.api_polls} API polls)"
    )
    for line in f.backwards[:5]:
        print(f"    {line}")
    print(f"  API: 5xx answers {dict(f.api_5xx) or 0}, transport errors {f.api_transport_errors}")
    for how, times in taken.items():
        held = sum(len(s.held) for s in f.signalled if s.how == how)
        no_spare = sum(1 for s in f.signalled if s.how == how and s.held and not s.spare)
        print(
            f"  takeover after {how} (signal → next step committed by another worker): {held} tasks held, "
            f"{len(times)} taken over ({no_spare} signals with no spare worker ready)"
            + (
                f": p50 {statistics.median(times):.2f}s, p99 "
                f"{_common.percentile(times, 99):.2f}s, max {max(times):.2f}s"
                if times
                else ""
            )
        )
    print(f"  in the logs: {dict(log_counts(soak.logs))}")
    print(f"  logs: {soak.logs}")

    not_completed = len(soak.tasks) - by_status["completed"]
    injected = {
        "SIGKILL": (f.kills, a.kills),
        "freezes": (f.freezes, a.freezes),
        "database terminations": (f.db_terminations, a.db_terminations),
        "Redis restarts": (f.redis_restarts, a.redis_restarts),
        "SIGTERM": (f.sigterms, a.sigterms),
    }
    short = {k: f"{got}/{want}" for k, (got, want) in injected.items() if got < want}
    server_errors = sum(n for status, n in f.api_5xx.items() if status != 503)
    promises = [
        ("every task completes", not_completed == 0, f"{not_completed} of {len(soak.tasks)} did not"),
        ("no effect duplicated", resent + unexpected == 0, f"{resent + unexpected} duplicated"),
        ("no effect missing", missing == 0, f"{missing} missing"),
        ("no task failed or dead-lettered by a fault", not broken, f"{len(broken)} failed or dead-lettered"),
        ("snapshots never move backwards", not f.backwards, f"{len(f.backwards)} decreases"),
        ("the API never answers 5xx (503 allowed)", server_errors == 0, f"{server_errors} answers"),
        ("every fault asked for was injected", not short, f"short: {short}"),
    ]
    print("promises:")
    for name, held, failure in promises:
        print(f"  {'ok  ' if held else 'FAIL'} {name}" + ("" if held else f": {failure}"))
    return all(held for _, held, _ in promises)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 2-3 minute smoke: fewer faults and tasks")
    parser.add_argument("--kills", type=int, help=f"SIGKILLs (default {FULL['kills']}, quick {QUICK['kills']})")
    parser.add_argument("--freezes", type=int, help=f"freezes past the lease ({FULL['freezes']}, {QUICK['freezes']})")
    parser.add_argument(
        "--db-terminations",
        type=int,
        help=f"times every backend of the soak's database is terminated ({FULL['db_terminations']}, "
        f"{QUICK['db_terminations']})",
    )
    parser.add_argument(
        "--sigterms", type=int, help=f"rolling SIGTERM restarts ({FULL['sigterms']}, {QUICK['sigterms']})"
    )
    parser.add_argument("--redis-restarts", type=int, help="restarts of the private redis-server (1)")
    parser.add_argument(
        "--tasks",
        type=int,
        help=f"tasks at least ({FULL['tasks']}, {QUICK['tasks']}); more are submitted while faults remain",
    )
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=1, help="pool processes per worker")
    parser.add_argument(
        "--in-flight",
        type=int,
        help="tasks kept moving at once (default: one per pool process but one, so the takeover "
        "measures the runtime, not a queue behind busy workers)",
    )
    parser.add_argument(
        "--stuck-after",
        type=float,
        default=30,
        help="seconds without a new step after which a task no longer counts as in flight",
    )
    parser.add_argument("--gap", default="1.5:3", help="seconds between faults, min:max")
    parser.add_argument("--warmup", type=float, default=5, help="seconds of work before the first fault")
    parser.add_argument(
        "--freeze-seconds", type=float, help="how long a frozen worker stays stopped (default: the lease + 2 s)"
    )
    parser.add_argument("--redis-outage", type=float, default=2)
    parser.add_argument("--sigterm-grace", type=float, default=60, help="then a SIGTERMed worker is SIGKILLed")
    parser.add_argument(
        "--rekill-depth",
        type=int,
        default=2,
        help="times one re-run step range is killed again (a quarter of --kills aim so)",
    )
    parser.add_argument("--api-poll", type=float, default=1.0)
    parser.add_argument("--tick", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for the faults")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        help="seconds after the last fault for every task to settle (default 300, quick 90)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep-db", action="store_true", help="keep the soak's database for inspection")
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # A database of its own on the server DATABASE_URL names (whatever database that names is
    # left alone), and the private Redis as every process's broker.
    server = urlsplit(os.environ.get("DATABASE_URL", _common.DEFAULTS["DATABASE_URL"]))
    db_name = f"runtime_soak_{os.getpid()}"
    args.redis_port = _common.free_port()
    os.environ["DATABASE_URL"] = urlunsplit(server._replace(path=f"/{db_name}"))
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{args.redis_port}/0"
    for key, value in SETTINGS.items():
        os.environ.setdefault(key, value)  # the caller's environment wins
    args.in_flight = args.in_flight or max(1, args.workers * args.concurrency - 1)
    args.drain_timeout = args.drain_timeout or (90 if args.quick else 300)
    args.freeze_seconds = args.freeze_seconds or float(os.environ["RUNTIME_LEASE_SECONDS"]) + 2
    _common.setup()

    soak = Soak(args, Path(tempfile.mkdtemp(prefix="soak-")), db_name)
    try:
        ok = report(soak, soak.run())
    finally:
        soak.stop_all()
        if not args.keep_db:
            _drop(server, db_name)
    raise SystemExit(0 if ok else 1)


def _drop(server: Any, name: str) -> None:
    import psycopg
    from django.db import connection

    connection.close()
    with psycopg.connect(
        host=server.hostname,
        port=server.port or 5432,
        user=server.username,
        password=server.password,
        dbname="postgres",
        autocommit=True,
    ) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
