"""/healthz and /readyz: is the process up, and can it do its work? And who may scrape /metrics.

/healthz answers from the process alone (no database, no broker): a failing one means
restart the process. /readyz checks what the web process needs to serve the API —
the database reachable, every migration on disk applied, the broker reachable — and
answers 503 naming what is missing: don't route traffic here (yet), the process is fine.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connections
from django.http import HttpRequest, JsonResponse

from runtime_site import dbpool
from runtime_site.errors import allow_methods, error_body
from runtime_site.lean import lean

TIMEOUT = 3  # seconds per check: a probe must answer before the orchestrator gives up on it
MIGRATIONS = "SELECT app, name FROM django_migrations"


def read_only(view: Any) -> Any:
    """A probe answers GET and HEAD; anything else is a JSON 405 (not CSRF's 403, logged as
    an attack, nor an OPTIONS that runs the whole check)."""
    return allow_methods("GET", "HEAD")(view)


def scrapers_only(view: Callable[[HttpRequest], Any]) -> Callable[[HttpRequest], Any]:
    """Who may scrape /metrics on the web port: with RUNTIME_METRICS_TOKEN set, whoever sends it
    as a bearer token (Prometheus: `authorization: {credentials_file: ...}`); without it, this
    host only (bin/run, a sidecar, an SSH tunnel). The web port is the public one, and a scrape
    tells every tenant's task counts, queue depths and open streams, and costs a database and a
    broker read each time: an open /metrics is both a leak and a lever. The client is the one
    uvicorn reports, so behind a proxy on this host it is the X-Forwarded-For client (uvicorn
    believes 127.0.0.1's by default) and a proxied scrape needs the token."""

    def guarded(request: HttpRequest) -> Any:
        token = settings.RUNTIME_METRICS_TOKEN
        if not token:
            if _loopback(request.META.get("REMOTE_ADDR")):
                return view(request)
            message = (
                "/metrics answers only this host unless RUNTIME_METRICS_TOKEN is set; scrape with that bearer token"
            )
            return JsonResponse(error_body("permission_denied", message), status=403)
        sent = request.META.get("HTTP_AUTHORIZATION", "")
        scheme, _, credentials = sent.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), token.encode()):
            return view(request)
        code, message = (
            ("authentication_failed", "the metrics token is not valid")
            if sent
            else ("not_authenticated", "send the metrics token: Authorization: Bearer <token>")
        )
        refused = JsonResponse(error_body(code, message), status=401)
        refused["WWW-Authenticate"] = 'Bearer realm="metrics"' + (', error="invalid_token"' if sent else "")
        return refused

    return guarded


def _loopback(address: str | None) -> bool:
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:  # no address, or a unix socket's path: not known to be this host
        return False
    # An IPv4 client as a dual-stack socket writes it (::ffff:127.0.0.1): Python before 3.13
    # judges the IPv6 form, which is no loopback, and refused this host's scraper.
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


async def lean_healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})


@lean(lean_healthz)  # on the event loop: a probe never waits behind the thread pool's requests
@read_only
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})


async def lean_readyz(request: HttpRequest) -> JsonResponse | None:
    """readyz on the event loop, for PostgreSQL and Redis (the embedded profile's SQLite file
    and broker folder are checked by the full view)."""
    if connections["default"].vendor != "postgresql" or not _redis_broker():
        return None
    applied: set[tuple[str, str]] | None = None
    database = broker = "ok"
    try:
        applied = await _applied_migrations_async()
    except Exception as exc:  # noqa: BLE001 (a probe: any failure is "unreachable", with its reason)
        database = f"unreachable: {_brief(exc)}"
    try:
        await _ping_broker_async()
    except Exception as exc:  # noqa: BLE001 (a probe: any failure is "unreachable", with its reason)
        broker = f"unreachable: {_brief(exc)}"
    on_disk = await asyncio.to_thread(_migrations_on_disk) if applied is not None else frozenset()
    return _ready(database, _migrations(applied, on_disk), broker)


@lean(lean_readyz)
@read_only
def readyz(request: HttpRequest) -> JsonResponse:
    applied: set[tuple[str, str]] | None = None
    database = broker = "ok"
    try:
        applied = _applied_migrations()
    except Exception as exc:  # noqa: BLE001 (a probe: any failure is "unreachable", with its reason)
        database = f"unreachable: {_brief(exc)}"
    try:
        _ping_broker()
    except Exception as exc:  # noqa: BLE001 (a probe: any failure is "unreachable", with its reason)
        broker = f"unreachable: {_brief(exc)}"
    return _ready(database, _migrations(applied, _migrations_on_disk() if applied is not None else frozenset()), broker)


def _migrations(applied: set[tuple[str, str]] | None, on_disk: frozenset[tuple[str, str]]) -> str:
    if applied is None:
        return "unknown: the database is unreachable"
    pending = sorted(f"{app}.{name}" for app, name in on_disk - applied)
    return "ok" if not pending else f"{len(pending)} not applied: {', '.join(pending[:5])}"


def _ready(database: str, migrations: str, broker: str) -> JsonResponse:
    checks = {"database": database, "migrations": migrations, "broker": broker}
    ok = all(value == "ok" for value in checks.values())
    return JsonResponse({"ok": ok, "checks": checks}, status=200 if ok else 503)


def _brief(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]


def _applied_migrations() -> set[tuple[str, str]]:
    """(app, name) of applied migrations. On PostgreSQL through a connection of its own,
    bounded by the probe's TIMEOUT (_probe_params, _ProbeConnection): the web process's pool
    would wait up to its own timeout for a database that is down, longer than a probe may take."""
    if connections["default"].vendor != "postgresql":
        with connections["default"].cursor() as cursor:  # the embedded SQLite file
            cursor.execute(MIGRATIONS)
            return set(cursor.fetchall())
    import psycopg

    with _ProbeConnection.connect(**_probe_params()) as conn:
        try:
            return set(conn.execute(MIGRATIONS).fetchall())
        except psycopg.errors.UndefinedTable:
            return set()  # a database that has never been migrated


async def _applied_migrations_async() -> set[tuple[str, str]]:
    import psycopg

    async with await _AsyncProbeConnection.connect(**_probe_params()) as conn:
        try:
            return set(await (await conn.execute(MIGRATIONS)).fetchall())
        except psycopg.errors.UndefinedTable:
            return set()


class _ProbeConnection(dbpool.DeadlineConnection):
    """The probe's connection: every round trip within TIMEOUT. The server's statement_timeout
    (_probe_params) bounds a statement the server runs; a frozen server (SIGSTOP, a host
    that hangs, a partition that drops packets) runs no timer of its own, and one that froze
    after the probe connected held /readyz for as long as it was frozen."""

    @classmethod
    def deadline(cls) -> tuple[float | None, str]:
        return TIMEOUT, "the readiness probe's deadline"


class _AsyncProbeConnection(dbpool.DeadlineAsyncConnection):
    """_ProbeConnection, for lean_readyz on the event loop."""

    @classmethod
    def deadline(cls) -> tuple[float | None, str]:
        return TIMEOUT, "the readiness probe's deadline"


def _probe_params() -> dict[str, Any]:
    """A connection of the probe's own with a short connect timeout: the web process's pools
    would wait up to their own timeout for a database that is down, longer than a probe may take."""
    db = settings.DATABASES["default"]
    params: dict[str, Any] = {
        "dbname": db["NAME"],
        "user": db["USER"],
        "password": db["PASSWORD"] or None,
        "host": db["HOST"] or None,
        "port": db["PORT"] or None,
    }
    return {
        **{k: v for k, v in params.items() if v},
        "connect_timeout": TIMEOUT,
        "options": f"-c statement_timeout={TIMEOUT * 1000}",
    }


@cache
def _migrations_on_disk() -> frozenset[tuple[str, str]]:
    """Read once per process: the code, and so its migrations, cannot change under it."""
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(None, ignore_no_migrations=True)
    return frozenset(loader.graph.leaf_nodes())  # the newest of each app; the rest come before them


def _redis_broker() -> bool:
    return settings.CELERY_BROKER_URL.startswith(("redis://", "rediss://"))


async def _ping_broker_async() -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(settings.CELERY_BROKER_URL, socket_connect_timeout=TIMEOUT, socket_timeout=TIMEOUT)
    try:
        await client.ping()
    finally:
        await client.aclose()


def _ping_broker() -> None:
    url = settings.CELERY_BROKER_URL
    if url.startswith("filesystem://"):  # the embedded profile: the queue is a folder
        folder = Path(settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"])
        probe = folder.parent / f".readyz-{time.monotonic_ns()}"
        probe.write_text("")  # writable, not just present
        probe.unlink()
        return
    import redis

    with redis.Redis.from_url(url, socket_connect_timeout=TIMEOUT, socket_timeout=TIMEOUT) as client:
        client.ping()
