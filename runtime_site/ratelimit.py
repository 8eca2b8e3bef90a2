"""Request rates per API key and per tenant on each surface (REST, SSE connects, /mcp),
counted in Redis so every web process shares one count (config/runtime.yaml `limits`).

A fixed window per surface: one INCR per counter, in one round trip, and the window's end is
the Retry-After. A limit is a guard against floods and runaway clients, not billing, so an
infrastructure error fails open: Redis down or slow never turns a request into a 500 and
never holds it up. The request goes through, one warning is logged, and Redis is left alone
for a few seconds so a dead server costs no timeout per request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import weakref
from typing import TYPE_CHECKING, NamedTuple

import redis
import redis.asyncio as aioredis
from django.conf import settings
from rest_framework.exceptions import Throttled

if TYPE_CHECKING:
    from tasks_app.auth import Principal

logger = logging.getLogger(__name__)

SURFACES = ("rest", "sse", "mcp")
# Redis must answer within this, or the request goes on unlimited (fail open).
REDIS_TIMEOUT = 0.25
# After a failure, Redis is not asked again for this long: a dead server costs one timeout, not one per request.
BACKOFF_SECONDS = 5.0

_lock = threading.Lock()
_clients: dict[str, redis.Redis] = {}
_skip_until = 0.0


class RateLimited(Throttled):
    """HTTP 429 with Retry-After (DRF sets the header from `wait`)."""

    wait: int  # set by Throttled; its stubs leave it undeclared

    def __init__(self, wait: int, scope: str) -> None:
        # DRF adds "Expected available in N seconds." to the detail.
        super().__init__(wait=wait, detail=f"the request rate limit of this {scope} is reached.")
        self.scope = scope


def surface_of(path: str) -> str:
    if path.rstrip("/") == "/mcp":
        return "mcp"
    if path.startswith("/runtime/tasks/") and path.rstrip("/").endswith("/events"):
        return "sse"
    return "rest"


def _client(url: str) -> redis.Redis:
    with _lock:
        if url not in _clients:
            _clients[url] = redis.Redis.from_url(
                url, socket_connect_timeout=REDIS_TIMEOUT, socket_timeout=REDIS_TIMEOUT, retry_on_timeout=False
            )
        return _clients[url]


def _counts(keys: list[str], window: int) -> list[int] | None:
    """INCR each key (expiring with its window) in one round trip; None when Redis fails."""
    if time.monotonic() < _skip_until:
        return None
    try:
        pipe = _client(settings.REDIS_URL).pipeline(transaction=False)
        for key in keys:
            pipe.incr(key)
            pipe.expire(key, window + 1, nx=True)
        return pipe.execute()[::2]
    except redis.RedisError as exc:
        _failed(exc)
        return None


def _failed(exc: Exception) -> None:
    global _skip_until  # noqa: PLW0603 (one process-wide back-off after a Redis failure)
    _skip_until = time.monotonic() + BACKOFF_SECONDS
    logger.warning(
        "rate limits not enforced for %.0f s: Redis failed (%s: %s); requests are let through",
        BACKOFF_SECONDS,
        type(exc).__name__,
        exc,
    )


class _Count(NamedTuple):
    keys: list[str]  # the key's counter, then the tenant's
    window: int
    per_key: int
    per_tenant: int
    now: float


def _count_for(principal: Principal, surface: str) -> _Count | None:
    """What to count for this request; None when nothing is limited."""
    limits = settings.RUNTIME.get("limits", {})
    per_key, per_tenant = limits.get(f"{surface}_per_key", 0), limits.get(f"{surface}_per_tenant", 0)
    if not (per_key or per_tenant) or not settings.REDIS_URL or principal.key is None:
        return None  # no limit configured, or the embedded profile (no Redis): see docs/operations.md
    window = max(1, int(limits.get("window_seconds", 60)))
    now = time.time()
    prefix = f"{settings.RUNTIME_DEPLOYMENT}:ratelimit:{surface}:{int(now // window)}"
    keys = [f"{prefix}:key:{principal.key}", f"{prefix}:tenant:{principal.tenant.pk}"]
    return _Count(keys, window, per_key, per_tenant, now)


def _judge(count: _Count, counts: list[int] | None) -> None:
    if counts is None:
        return
    wait = max(1, math.ceil((int(count.now // count.window) + 1) * count.window - count.now))
    if count.per_key and counts[0] > count.per_key:
        raise RateLimited(wait, "key")
    if count.per_tenant and counts[1] > count.per_tenant:
        raise RateLimited(wait, "tenant")


def enforce(principal: Principal, surface: str) -> None:
    """Count this request against its key and its tenant; raise RateLimited past either."""
    if (count := _count_for(principal, surface)) is not None:
        _judge(count, _counts(count.keys, count.window))


# The event loop's client (the lean paths: runtime_site/lean.py), one per loop as redis-py's
# asyncio connections belong to the loop that made them.
_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, aioredis.Redis]] = (
    weakref.WeakKeyDictionary()
)


async def aenforce(principal: Principal, surface: str) -> None:
    """enforce() on the event loop: the same counters, limits, timeout and fail-open back-off."""
    if (count := _count_for(principal, surface)) is None or time.monotonic() < _skip_until:
        return
    clients = _async_clients.setdefault(asyncio.get_running_loop(), {})
    if (client := clients.get(settings.REDIS_URL)) is None:
        client = clients[settings.REDIS_URL] = aioredis.Redis.from_url(
            settings.REDIS_URL,
            socket_connect_timeout=REDIS_TIMEOUT,
            socket_timeout=REDIS_TIMEOUT,
            retry_on_timeout=False,
        )
    try:
        pipe = client.pipeline(transaction=False)
        for key in count.keys:
            pipe.incr(key)
            pipe.expire(key, count.window + 1, nx=True)
        counts = (await pipe.execute())[::2]
    except (redis.RedisError, OSError, TimeoutError) as exc:
        _failed(exc)
        return
    _judge(count, counts)
