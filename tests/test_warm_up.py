"""A web process warms up before it serves (runtime_site.asgi.warm_up, in the ASGI lifespan's
startup): what its first write request would otherwise load is loaded already. Run in a
process of its own, since this test process has loaded everything long ago."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import database_url

pytestmark = pytest.mark.django_db

PROBE = """
import asyncio, sys
from runtime_site.asgi import application
def loaded():
    # django-eventstream's publisher, the largest part of a first write's cost (it imports werkzeug)
    return {"django_grip": "django_grip" in sys.modules}
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
print(before, loaded(), sent)
"""


def test_the_web_process_loads_what_a_first_write_needs_before_it_serves():
    env = {**os.environ, "DATABASE_URL": database_url(), "DJANGO_SETTINGS_MODULE": "runtime_site.settings"}
    run = subprocess.run(
        [sys.executable, "-c", PROBE], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    line = run.stdout.strip().splitlines()[-1]
    assert line.startswith("{'django_grip': False}"), line  # not loaded by the import
    assert "{'django_grip': True}" in line, line  # loaded by the startup
    assert line.endswith("['lifespan.startup.complete']"), line
