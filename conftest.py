"""Shared fixtures: personas with API keys, and real worker/beat/web processes.

Processes get the same database (pytest-django's test database), Redis namespace and
data folder as the test, so they see exactly what the test wrote.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from rest_framework.test import APIClient

ROOT = Path(__file__).resolve().parent


def wait_until(
    predicate: Callable[[], Any], *, timeout: float, interval: float = 0.1, what: str | Callable[[], str] = "condition"
) -> Any:
    """Poll until predicate() is truthy; fail with `what` (or what it returns then, to say what
    was found instead) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


def settled(task: Any, timeout: float = 90) -> Any:
    """The task, re-read once it stopped for good or for a person (completed, failed, input_required)."""
    from tasks_app.models import Task

    wait_until(
        lambda: Task.objects.get(id=task.id).status in ("completed", "failed", "input_required"),
        timeout=timeout,
        what="the task to settle",
    )
    return Task.objects.get(id=task.id)


@dataclass
class Persona:
    user: Any
    tenant: Any
    role: str
    token: str

    def client(self) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {self.token}")
        return client


@pytest.fixture(autouse=True)
def fast_password_hashing(request: pytest.FixtureRequest, settings: Any) -> None:
    """In-process tests sign people in with a fast hasher: the product's (PBKDF2, ~0.5 s a
    password by design) made every persona that signs in cost that, and no test is about the
    hashing. Tests with processes keep it: those verify what this process hashed, and their
    timing is the product's."""
    if "processes" not in request.fixturenames:
        settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@contextlib.contextmanager
def emits(task: Any, *, events: list[str], audit: list[str]) -> Iterator[list[str]]:
    """Zulip-style event assertions: the block publishes exactly `events` for the task (after
    its transaction commits) and writes exactly `audit` records to its chain, in this order.
    `emits(task, events=[], audit=[])` around a call that raises: nothing leaked out."""
    from unittest import mock

    from django.test import TestCase

    from tasks_app.models import AuditRecord

    published: list[str] = []
    last = AuditRecord.objects.filter(task_id=task.id).order_by("-seq").values_list("seq", flat=True).first() or 0

    def publish(task_id: Any, event_type: str, data: dict[str, Any]) -> None:
        if str(task_id) == str(task.id):
            published.append(event_type)

    try:
        # A rolled-back action's on-commit callbacks are dropped with it, as in production.
        with (
            mock.patch("tasks_app.streams.publish.publish", publish),
            TestCase.captureOnCommitCallbacks(execute=True),
        ):
            yield published
    finally:
        written = list(
            AuditRecord.objects.filter(task_id=task.id, seq__gt=last).order_by("seq").values_list("action", flat=True)
        )
        assert (published, written) == (events, audit), f"published {published}, audited {written}"


def make_persona(tenant_slug: str, username: str, role: str) -> Persona:
    from django.contrib.auth import get_user_model

    from tasks_app.auth import issue_api_key
    from tasks_app.models import Membership, Tenant

    tenant, _ = Tenant.objects.get_or_create(slug=tenant_slug, defaults={"name": tenant_slug})
    user, _ = get_user_model().objects.get_or_create(username=username)
    Membership.objects.get_or_create(tenant=tenant, user=user, defaults={"role": role})
    _, token = issue_api_key(tenant, user, role=role, name=f"{username}-key")
    return Persona(user, tenant, role, token)


@pytest.fixture
def alice(db: None) -> Persona:
    """acme operator."""
    return make_persona("acme", "alice", "operator")


@pytest.fixture
def victor(db: None) -> Persona:
    """acme viewer: may read, may not start or cancel."""
    return make_persona("acme", "victor", "viewer")


@pytest.fixture
def mallory(db: None) -> Persona:
    """globex admin: must never see acme's tasks."""
    return make_persona("globex", "mallory", "admin")


# Ports for the servers tests start, below the kernel's ephemeral range (32768-60999 on Linux by
# default): a port the kernel handed out with bind(0) is free only until the next outgoing
# connection or bind(0) anywhere on the machine takes it, and a uvicorn started on it a moment
# later died with "address already in use" (a CI flake). Each xdist worker has its own block.
_PORTS_PER_WORKER = 2000
_next_port: list[int] = []


def free_port() -> int:
    """A port nobody on this machine listens on, which no other test of this run is handed."""
    if not _next_port:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
        index = int(worker) if worker.isdigit() else 0
        # Two runs on one machine (CI beside a session's run): a random start within the block.
        base = 12000 + (index % 10) * _PORTS_PER_WORKER
        _next_port.append(base + int.from_bytes(os.urandom(2)) % _PORTS_PER_WORKER)
    base = _next_port[0] - _next_port[0] % _PORTS_PER_WORKER
    for _ in range(_PORTS_PER_WORKER):
        port = _next_port[0]
        _next_port[0] = base + (port + 1 - base) % _PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {base}-{base + _PORTS_PER_WORKER - 1}")


def database_url() -> str:
    from django.db import connection

    db = connection.settings_dict
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


# The process commands, exactly as compose.yaml runs them (tests/test_deployment.py checks it).
WEB = ["uvicorn", "runtime_site.asgi:application", "--host", "127.0.0.1", "--port"]
# Leases that expire in seconds, for the tests that kill, freeze or steer real workers.
FAST_LEASES = {"RUNTIME_LEASE_SECONDS": "3", "RUNTIME_HEARTBEAT_SECONDS": "1", "RUNTIME_SCAN_SECONDS": "1"}

WORKER = [
    "celery",
    "-A",
    "runtime_site",
    "worker",
    "-Q",
    "steps,maintenance",
    "-l",
    "INFO",
    "--without-gossip",
    "--without-mingle",
    "-c",
]
BEAT = ["celery", "-A", "runtime_site", "beat", "-l", "INFO", "-s"]


class Processes:
    """Starts real processes (worker, beat, web) and always stops them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, **overrides: str) -> dict[str, str]:
        env = {**os.environ, "DATABASE_URL": database_url(), "PYTHONUNBUFFERED": "1", **overrides}
        return {k: v for k, v in env.items() if v is not None}

    def start(self, name: str, args: list[str], **env: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}-{len(self.procs)}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            args, cwd=ROOT, env=self.env(**env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )  # its own group: kill -9 takes the pool children too
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def worker(self, *, concurrency: int = 1, ready: bool = False, **env: str) -> subprocess.Popen[bytes]:
        """A Celery worker; with ready=True, returned once it consumes (its " ready." line):
        booting one takes seconds on a busy machine, and a clock a test starts before then
        (a synchronous MCP call's wait, say) would measure the boot, not the product."""
        proc = self.start("worker", [sys.executable, "-m", *WORKER, str(concurrency)], **env)
        if ready:
            log = Path(proc.log_path)  # type: ignore[attr-defined]
            wait_until(lambda: " ready." in log.read_text(errors="replace"), timeout=120, what="the worker to be ready")
        return proc

    def beat(self, **env: str) -> subprocess.Popen[bytes]:
        return self.start("beat", [sys.executable, "-m", *BEAT, str(self.tmp / f"beat-{len(self.procs)}")], **env)

    def web(self, port: int, **env: str) -> subprocess.Popen[bytes]:
        """uvicorn on `port`, returned once it answers (with its static files collected, as bin/run does)."""
        collect_static()
        proc = self.start("web", [sys.executable, "-m", *WEB, str(port)], **env)
        log = Path(proc.log_path)  # type: ignore[attr-defined]

        def up() -> bool:
            if proc.poll() is not None:  # say why at once, not after the timeout
                raise AssertionError(f"uvicorn exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
            return answers(f"http://127.0.0.1:{port}/healthz")

        # Booting Django takes a few seconds idle, far more beside a busy test worker.
        wait_until(
            up, timeout=90, what=lambda: f"uvicorn to answer; its log:\n{log.read_text(errors='replace')[-3000:]}"
        )
        return proc

    @staticmethod
    def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.log_path}\n" + Path(p.log_path).read_text(errors="replace")[-4000:]  # type: ignore[attr-defined]
            for p in self.procs
        )


@pytest.fixture
def processes(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Processes]:
    purge_queues()
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        print(procs.logs())


_static_collected: list[bool] = []


def collect_static() -> None:
    """`manage.py collectstatic` into this run's STATIC_ROOT, once per test session."""
    from django.core.management import call_command

    if not _static_collected:
        call_command("collectstatic", interactive=False, verbosity=0)
        _static_collected.append(True)


def answers(url: str) -> bool:
    """True once an HTTP server answers at url (with anything but a server error)."""
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.TransportError:
        return False


@pytest.fixture
def private_redis(tmp_path: Path, processes: Processes) -> tuple[int, Callable[[], subprocess.Popen[bytes]]]:
    """(port, start): a redis-server of our own, so killing and restarting it disturbs nobody."""
    import shutil

    port = free_port()
    binary = shutil.which("redis-server")
    assert binary, "redis-server is needed for this test"
    args = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(tmp_path),
    ]

    def start() -> subprocess.Popen[bytes]:
        proc = processes.start("redis", args)
        wait_until(
            lambda: (
                subprocess.run(
                    ["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True, check=False
                ).stdout.strip()
                == "PONG"
            ),
            timeout=10,
            what="redis",
        )
        return proc

    return port, start


def purge_queues() -> None:
    """Drop messages left by earlier tests so a new worker starts on an empty queue, and those
    a killed worker left delivered but unacknowledged (kombu's unacked hash and its index),
    which would otherwise come back at the visibility timeout in some later test."""
    from runtime_site.celery import app

    with app.connection_for_write() as conn:
        for queue in ("steps", "maintenance"):
            with contextlib.suppress(Exception):  # a queue that does not exist yet is empty
                conn.default_channel.queue_purge(queue)
        channel = conn.default_channel
        # Unprefixed: kombu's client prefixes DEL's keys itself (global_keyprefix); prefixed
        # here too, they named keys that never exist, and the hash outlived every test.
        channel.client.delete(channel.unacked_key, channel.unacked_index_key)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def pytest_configure(config: pytest.Config) -> None:
    settings.RUNTIME_BLOB_DIR.mkdir(parents=True, exist_ok=True)
    config.addinivalue_line(
        "markers", "e2e: starts real processes or a browser (the slow tier; bin/test -m 'not e2e' skips it)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The two tiers: a test that starts processes (through the `processes` fixture) or a
    browser is e2e; the rest runs in-process and is the fast tier a developer runs on each change.
    A test with processes also commits for real (transaction=True), whatever its module says:
    a worker or web process never sees rows a rolled-back test transaction holds."""
    for item in items:
        if "processes" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
            if item.get_closest_marker("django_db"):
                item.add_marker(pytest.mark.django_db(transaction=True))


class SseClient:
    """A real SSE client on its own thread: collects parsed events until closed or the
    stream ends. Each event is a dict with type, id and data (parsed JSON)."""

    def __init__(self, url: str, token: str, last_event_id: str | None = None) -> None:
        import threading

        self.url, self.token, self.last_event_id = url, token, last_event_id
        self.events: list[dict[str, Any]] = []
        self.status: int | None = None
        self.closed = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def live(self) -> bool:
        """Still reading: neither closed by the test nor ended by the server."""
        return not self.closed and self._thread.is_alive()

    def _run(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.token}"}
        if self.last_event_id:
            headers["Last-Event-ID"] = self.last_event_id
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(10, read=60)) as client,
                client.stream("GET", self.url, headers=headers) as response,
            ):
                self.status = response.status_code
                event: dict[str, Any] = {}
                for line in response.iter_lines():
                    if self.closed:
                        return
                    if line == "":
                        if "data" in event and event.get("type") not in (None, "stream-open", "keep-alive"):
                            raw = event["data"]
                            event["data"] = json.loads(raw) if raw else None
                            self.events.append(event)
                        event = {}
                    elif not line.startswith(":"):
                        name, _, value = line.partition(":")
                        value = value.removeprefix(" ")
                        key = {"event": "type"}.get(name, name)
                        event[key] = event[key] + "\n" + value if key == "data" and key in event else value
        except Exception:  # noqa: BLE001, S110 (closed under us, or the server went away: the test decides)
            pass

    def close(self) -> None:
        self.closed = True

    def of(self, type: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e["type"] == type]

    def deduplicated(self) -> list[dict[str, Any]]:
        """The client contract: drop any event whose seq is not above the last one seen."""
        out, last = [], -1
        for event in list(self.events):
            seq = event["data"]["seq"]
            if seq > last:
                out.append(event)
                last = seq
        return out
