import asyncio
import gc
import importlib
import logging
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

logger = logging.getLogger(__name__)

# How long a booting web process waits for its connections (warm_connections) before it
# serves anyway: a database or broker not there yet must not hold up /healthz for long.
WARM_CONNECTIONS_SECONDS = 3.0


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


def warm_connections() -> None:
    """Opens what a fresh web process's first writes otherwise open while their clients
    wait: the sync views' database pool (RUNTIME_DB_POOL_MIN connections), the Redis clients
    of the event publisher and the rate limiter, and the broker connection with the slice
    queue declared. Under bench/api.py's load the first create and steering command of a
    process took 60-100 ms, three to five times the next ones. Each part is best effort:
    what is not reachable yet is opened by the request that needs it, as before."""
    from celery import current_app
    from django.conf import settings
    from django.db import connection
    from django_eventstream import eventstream

    from runtime_site import ratelimit

    def database() -> None:
        connection.ensure_connection()  # opens the pool, which fills to min_size in the background
        connection.close()  # back to the pool
        pool = getattr(connection, "pool", None)
        if pool is not None:
            pool.wait(WARM_CONNECTIONS_SECONDS)

    def redis() -> None:
        if eventstream.redis_client is not None:
            eventstream.redis_client.ping()
        if settings.REDIS_URL:  # the embedded profile has no Redis, and its limiter none to open
            ratelimit.connect()

    def broker() -> None:
        with current_app.producer_or_acquire() as producer:
            producer.connection.ensure_connection(max_retries=1)
            producer.maybe_declare(current_app.amqp.queues[settings.CELERY_TASK_DEFAULT_QUEUE])

    for part in (database, redis, broker):
        try:
            part()
        except Exception as exc:  # noqa: BLE001 (best effort: any failure leaves it to the first request)
            logger.warning("web process warm-up: %s not ready (%s); its first request will connect", part.__name__, exc)


def freeze_what_is_loaded() -> None:
    """What a web process has loaded by now lives as long as it does. Frozen, the cyclic
    collector no longer walks it: each full collection walked all of Django, DRF and Celery
    with every thread stopped, 90-116 ms about every 20 s under bench/api.py's load, and
    those were the slowest creates and steering commands of a run (seen with gc.callbacks)."""
    gc.collect()
    gc.freeze()


class FlushOnShutdown:
    """The ASGI lifespan: at startup the web process warms up (warm_up, warm_connections,
    freeze_what_is_loaded); uvicorn ends by raising again the SIGTERM it caught, which runs
    no atexit hook, so its lifespan shutdown is where the web process exports the spans it
    still holds (for at most tracing.SHUTDOWN_SECONDS)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await asyncio.to_thread(warm_up)
                try:
                    await asyncio.wait_for(asyncio.to_thread(warm_connections), WARM_CONNECTIONS_SECONDS)
                except TimeoutError:
                    logger.warning(
                        "web process warm-up: connections not ready in %s s; serving", WARM_CONNECTIONS_SECONDS
                    )
                freeze_what_is_loaded()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await asyncio.to_thread(tracing.shutdown)
                await send({"type": "lifespan.shutdown.complete"})
                return


application = FlushOnShutdown(ChunkedBodyASGI(ByViewKind()))
