import asyncio
import importlib
import os
from typing import Any

from django.core.asgi import get_asgi_application

from runtime_site import tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runtime_site.settings")
# Only the ASGI web process pools its database connections (see settings.RUNTIME_DB_POOL).
os.environ.setdefault("RUNTIME_DB_POOL", "true")
tracing.configure_web()  # before Django loads: it adds its middleware (off without an OTLP endpoint)
get_asgi_application()  # django.setup(), once, before the handlers below load the middleware

from runtime_site.handlers import ByViewKind  # noqa: E402 (needs the settings loaded above)
from runtime_site.middleware import ChunkedBodyASGI  # noqa: E402


def warm_up() -> None:
    """What a web process otherwise loads on its first write request, loaded before it takes
    any (uvicorn serves once the lifespan's startup is complete): the first create cost
    114 ms of CPU, seven times the next one, and a freshly started process answered its
    first create and steering command in 300 ms under load (bench/api.py's p99). Most of
    it: django-eventstream's publisher (it imports django_grip, and that werkzeug) and
    Celery's result backend (an entry-point scan). Imports only, no I/O: a database or
    broker not there yet must not hold up the boot (/healthz, /readyz)."""
    from celery import current_app

    importlib.import_module("django_grip")  # what django-eventstream imports on its first publish
    current_app.backend  # noqa: B018 (loading it is the point; per thread, the scan's first time is the cost)


class FlushOnShutdown:
    """The ASGI lifespan: at startup the web process warms up (warm_up); uvicorn ends by
    raising again the SIGTERM it caught, which runs no atexit hook, so its lifespan
    shutdown is where the web process exports the spans it still holds (for at most
    tracing.SHUTDOWN_SECONDS)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await asyncio.to_thread(warm_up)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await asyncio.to_thread(tracing.shutdown)
                await send({"type": "lifespan.shutdown.complete"})
                return


application = FlushOnShutdown(ChunkedBodyASGI(ByViewKind()))
