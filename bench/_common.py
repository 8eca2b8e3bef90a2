"""What the bench scripts share: environment defaults, a fresh database, worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULTS = {
    "DJANGO_SETTINGS_MODULE": "runtime_site.settings",
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/runtime_bench",
    "REDIS_URL": "redis://127.0.0.1:6379/0",
    "DJANGO_SECRET_KEY": "bench-only",
    "RUNTIME_DEPLOYMENT": f"bench-{os.getpid()}",
    "RUNTIME_DATA_DIR": f"/tmp/runtime-bench-{os.getpid()}",
    "RUNTIME_LOG_LEVEL": "WARNING",
    # Benchmarks measure capacity, not the request limits (config/runtime.yaml `limits`).
    **{f"LIMITS_{surface}_PER_{who}": "0" for surface in ("REST", "SSE", "MCP") for who in ("KEY", "TENANT")},
    "LIMITS_QUEUED_TASKS_PER_TENANT": "0",
}


def setup(root: Path = ROOT, **overrides: str) -> None:
    """Environment defaults (the caller's environment wins), a fresh bench database, django.setup().
    root: the build whose code this process runs (its migrations, its modules first on the path)."""
    if root != ROOT:  # its modules first, and its working directory (config/ and what is put on the path from it)
        sys.path.insert(0, str(root))
        os.chdir(root)
    for key, value in {**DEFAULTS, **overrides}.items():
        os.environ.setdefault(key, value)
    import psycopg

    url = urlsplit(os.environ["DATABASE_URL"])
    name = url.path.lstrip("/")
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
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=root, check=True)
    import django

    django.setup()


def start(args: list[str], log: Path | None = None, cwd: Path = ROOT, **env: str) -> subprocess.Popen[bytes]:
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 (lives as long as the process)
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=cwd,
        env={**os.environ, **env},
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def worker(log: Path | None = None, *extra: str, cwd: Path = ROOT, **env: str) -> subprocess.Popen[bytes]:
    return start(
        [
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
            *extra,
        ],
        log,
        cwd,
        **env,
    )


def wait(predicate: Callable[[], object], timeout: float = 600, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("bench timed out")
        time.sleep(interval)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def operator_key() -> tuple[object, str]:
    """A bench tenant with an operator and an API key: (tenant, token)."""
    from django.contrib.auth import get_user_model

    from tasks_app.auth import issue_api_key
    from tasks_app.models import Membership, Tenant

    tenant = Tenant.objects.create(slug="bench", name="bench")
    user = get_user_model().objects.create(username="bench")
    Membership.objects.create(tenant=tenant, user=user, role="operator")
    return tenant, issue_api_key(tenant, user, role="operator", name="bench")[1]


def export(ref: str) -> Path:
    """`ref` of this repository as plain files in a temp folder (no worktree, no checkout)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"bench-{ref.replace('/', '_')}-"))
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far: the machine is shared, so beside latency
    the benches report what the work cost a process, which other load moves less."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def web(logs: Path, *extra: str, cwd: Path = ROOT, **env: str) -> tuple[subprocess.Popen[bytes], str]:
    """A uvicorn process on a free port, once it answers: (process, base URL). `cwd`: the
    code it runs (another checkout, for a before/after comparison)."""
    import httpx

    port = free_port()
    proc = start(
        ["uvicorn", "runtime_site.asgi:application", "--port", str(port), "--log-level", "warning", *extra],
        logs / "web.log",
        cwd,
        **env,
    )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait(up, timeout=30, interval=0.1)
    return proc, base


class RawHttp:
    """An HTTP/1.1 client of one keep-alive connection, for load: httpx spends 3-4 ms of CPU
    per request on this machine (more than the web process it measures, which then waits
    on the client's event loop); this one a tenth of that. It speaks only what the benches
    need: a request with an optional JSON body, an answer with Content-Length or chunked."""

    def __init__(self, base: str, token: str) -> None:
        host, _, port = base.removeprefix("http://").partition(":")
        self.host, self.port, self.token = host, int(port or 80), token
        self.reader: Any = None
        self.writer: Any = None

    async def _open(self) -> None:
        import asyncio

        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def request(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        import json

        if self.writer is None:
            await self._open()
        payload = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.token}\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + payload)
        status, headers = await self._head()
        if headers.get(b"transfer-encoding") == b"chunked":
            data = b""
            while size := int((await self.reader.readline()).strip(), 16):
                data += (await self.reader.readexactly(size + 2))[:-2]
            await self.reader.readline()
        else:
            data = await self.reader.readexactly(int(headers.get(b"content-length", b"0")))
        if headers.get(b"connection") == b"close":
            await self.close()
        return status, data

    async def _head(self) -> tuple[int, dict[bytes, bytes]]:
        lines = (await self.reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return int(lines[0].split(b" ")[1]), headers

    async def stream(self, path: str) -> Any:
        """GET `path` and yield the decoded chunks of its chunked answer as they arrive."""
        if self.writer is None:
            await self._open()
        self.writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.token}\r\n\r\n".encode()
        )
        status, _ = await self._head()
        if status != 200:
            raise RuntimeError(f"GET {path}: {status}")
        while size := int((await self.reader.readline()).strip(), 16):
            yield (await self.reader.readexactly(size + 2))[:-2].decode()

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = self.reader = None
