"""A web process warms up before it serves (the ASGI lifespan's startup, runtime_site.asgi):
what its first write request would otherwise load is loaded, its database pool is open,
and what it has loaded is frozen out of the cyclic collector's walks. Run in a process of
its own, since this test process has loaded everything long ago."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import httpx
import pytest

from conftest import Processes, database_url, free_port

pytestmark = pytest.mark.django_db

PROBE = """
import asyncio, gc, sys
from runtime_site.asgi import application
def loaded():
    # django-eventstream's publisher, the largest part of a first write's cost (it imports werkzeug)
    return {"django_grip": "django_grip" in sys.modules}
def opened():
    from django.db import connections
    pools = getattr(connections["default"], "_connection_pools", None)  # None: SQLite (the embedded profile)
    return {"frozen": gc.get_freeze_count(), "pooled": pools["default"].get_stats()["pool_size"] if pools else 0}
print(opened())
before = loaded()

async def lifespan():
    sent = []
    messages = iter([{"type": "lifespan.startup"}])
    async def receive():
        try:
            return next(messages)
        except StopIteration:
            await asyncio.Event().wait()
    async def send(message):
        sent.append(message["type"])
        if message["type"] == "lifespan.startup.complete":
            raise SystemExit(0)
    try:
        await application({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    except SystemExit:
        pass
    return sent

sent = asyncio.run(lifespan())
print(opened())
print(before, loaded(), sent)
"""


def boot(*unset: str, **env: str) -> list[str]:
    env = {**os.environ, "DATABASE_URL": database_url(), "DJANGO_SETTINGS_MODULE": "runtime_site.settings", **env}
    env = {name: value for name, value in env.items() if name not in unset}
    run = subprocess.run(
        [sys.executable, "-c", PROBE], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return [*run.stdout.strip().splitlines()[-3:], run.stderr]


def test_the_web_process_loads_what_a_first_write_needs_before_it_serves():
    *_, line, _ = boot()
    assert line.startswith("{'django_grip': False}"), line  # not loaded by the import
    assert "{'django_grip': True}" in line, line  # loaded by the startup
    assert line.endswith("['lifespan.startup.complete']"), line


def test_the_web_process_opens_its_pool_and_freezes_its_heap_before_it_serves():
    before, after, _, _ = boot(RUNTIME_DB_POOL_MIN="3")
    before, after = ast.literal_eval(before), ast.literal_eval(after)
    assert before["pooled"] == 0 and after["pooled"] >= 3, (before, after)
    # The interpreter's own start freezes a few hundred objects; Django and the apps are far more.
    assert after["frozen"] > before["frozen"] + 50_000, (before, after)


def test_a_web_process_boots_without_its_database_and_broker():
    # Nothing listens on port 9 (discard): every connection is refused at once.
    *_, line, log = boot(DATABASE_URL="postgres://postgres@127.0.0.1:9/none", REDIS_URL="redis://127.0.0.1:9/0")
    assert line.endswith("['lifespan.startup.complete']"), line
    for part in ("database", "redis", "broker"):
        assert f"web process warm-up: {part} not ready" in log, log


def test_the_embedded_profile_boots_warm_without_a_warning(tmp_path):
    # bin/run's default: SQLite and the filesystem broker, no Redis. Every boot warned
    # "redis not ready (Redis URL must specify one of the following schemes ...); its first
    # request will connect": the limiter's client was opened from an empty REDIS_URL.
    *_, line, log = boot("DATABASE_URL", "REDIS_URL", RUNTIME_DATA_DIR=str(tmp_path))
    assert line.endswith("['lifespan.startup.complete']"), line
    assert "not ready" not in log, log


@pytest.mark.django_db(transaction=True)  # the web process reads alice's key
def test_a_pool_capped_below_the_boot_minimum_still_serves(alice, processes: Processes):
    # RUNTIME_DB_POOL_MAX=1 worked while the pool's minimum was 1; with the boot's 2, every
    # request that touched the database was a 500 ("max_size must be greater or equal than
    # min_size") while /readyz answered 200.
    port = free_port()
    processes.web(port, RUNTIME_DB_POOL_MAX="1")
    listed = httpx.get(
        f"http://127.0.0.1:{port}/runtime/tasks", headers={"Authorization": f"Bearer {alice.token}"}, timeout=30
    )
    assert listed.status_code == 200, listed.text
