"""/healthz says the process is up and needs nothing else; /readyz says whether it can serve
(database reachable, migrations applied, broker reachable) and names what is missing.
Each against a real uvicorn, with real PostgreSQL and Redis or with ports nobody listens on."""

from __future__ import annotations

import httpx
import psycopg
import pytest

from conftest import Processes, database_url, free_port

pytestmark = pytest.mark.django_db(transaction=True)


def probe(port: int, path: str) -> tuple[int, dict]:
    response = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=15)
    return response.status_code, response.json()


def test_ready_with_database_broker_and_migrations(processes: Processes):
    port = free_port()
    processes.web(port)
    assert probe(port, "/healthz") == (200, {"ok": True})
    assert probe(port, "/readyz") == (
        200,
        {"ok": True, "checks": {"database": "ok", "migrations": "ok", "broker": "ok"}},
    )


def test_up_but_not_ready_without_database_and_broker(processes: Processes):
    port, nobody = free_port(), free_port()
    processes.web(
        port, DATABASE_URL=f"postgres://postgres@127.0.0.1:{nobody}/runtime", REDIS_URL=f"redis://127.0.0.1:{nobody}/0"
    )
    assert probe(port, "/healthz") == (200, {"ok": True})  # the process itself is fine: don't restart it
    status, body = probe(port, "/readyz")
    assert status == 503 and body["ok"] is False
    assert body["checks"]["database"].startswith("unreachable: ")
    assert body["checks"]["migrations"] == "unknown: the database is unreachable"
    assert body["checks"]["broker"].startswith("unreachable: ")


def test_not_ready_until_migrated(processes: Processes):
    """A database the deploy has not migrated yet: reachable, and 503 naming the missing migrations."""
    url = database_url()
    empty = url.rsplit("/", 1)[1] + "_unmigrated"
    admin = url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{empty}"')
        conn.execute(f'CREATE DATABASE "{empty}"')
    try:
        port = free_port()
        web = processes.web(port, DATABASE_URL=url.rsplit("/", 1)[0] + f"/{empty}")
        status, body = probe(port, "/readyz")
        assert status == 503
        assert body["checks"]["database"] == "ok" and body["checks"]["broker"] == "ok"
        assert " not applied: " in body["checks"]["migrations"]
        assert "tasks_app." in body["checks"]["migrations"] or "admin." in body["checks"]["migrations"]
        processes.kill(web)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{empty}" WITH (FORCE)')


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
@pytest.mark.parametrize("method", ["post", "put", "delete", "options"])
def test_probes_answer_only_get_and_head(client, path, method):
    """POST was CSRF's 403 (logged as an attack) and OPTIONS ran the whole check or scrape:
    it is answered with Allow alone."""
    response = getattr(client, method)(path)
    assert response.status_code == (200 if method == "options" else 405)
    assert response["Allow"] == "GET, HEAD, OPTIONS"
    if method == "options":
        assert response.content == b""
