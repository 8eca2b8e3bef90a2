"""Request rates per API key and per tenant on each surface (REST, SSE connects, /mcp),
counted in Redis so every web process shares one count (config/runtime.yaml `limits`).

A fixed window per surface: one INCR per counter, in one round trip, and the window's end is
the Retry-After. A limit is a guard against floods and runaway clients, not billing, so an
infrastructure error fails open: Redis down or slow never turns a request into a 500 and
never holds it up. The request goes through, one warning is logged, and Redis is left alone
for a few seconds so a dead server costs no timeout per request.

Failed authentications are limited per client address (`limits.auth_failures_per_address`),
before any key or token is checked: a wrong key costs a lookup and a hash, a forged access
token an RSA verification, and whoever sends them needs no key of ours to be counted against.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

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

    def __init__(self, wait: int, scope: str, detail: str = "") -> None:
        # DRF adds "Expected available in N seconds." to the detail.
        super().__init__(wait=wait, detail=detail or f"the request rate limit of this {scope} is reached.")
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


def connect() -> None:
    """Connects the limiter's client (runtime_site.asgi.warm_connections)."""
    _client(settings.REDIS_URL).ping()


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


# --- failed authentications per client address -----------------------------------------------

# Addresses past their limit, as this process learned it: {address: when its window ends
# (time.time())}. Asked before a credential is checked, with no round trip, so a refused address
# costs nothing; each web process learns it from its own first failure past the limit (the count
# is Redis's, shared), so one more check per process and window gets through at most.
_refused_until: dict[str, float] = {}
# The embedded profile's counts (no Redis; one web process): {(address, window): failures}.
_local_failures: dict[tuple[str, int], int] = {}
_KEEP = 10_000  # entries past which ended windows are dropped (many addresses failing at once)


def client_address(request: Any) -> str | None:
    """The address failures are counted by: the client uvicorn reports (behind a proxy, its
    X-Forwarded-For, when uvicorn trusts the proxy: --forwarded-allow-ips), an IPv6 client by
    its /64, which one host commonly holds whole. None when not known (a unix socket)."""
    try:
        address = ipaddress.ip_address(request.META.get("REMOTE_ADDR") or "")
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


def _failure_limit() -> tuple[int, int]:
    limits = settings.RUNTIME.get("limits", {})
    return int(limits.get("auth_failures_per_address", 0) or 0), max(1, int(limits.get("window_seconds", 60)))


class AuthFailuresLimited(RateLimited):
    def __init__(self, wait: int) -> None:
        super().__init__(wait, "address", "too many failed authentications from this address.")


def check_address(address: str | None) -> None:
    """Raise AuthFailuresLimited while `address` is past its failure limit (as this process knows)."""
    if address is None or not _failure_limit()[0]:
        return
    until = _refused_until.get(address)
    if until is not None and (left := until - time.time()) > 0:
        raise AuthFailuresLimited(max(1, math.ceil(left)))


def count_failure(address: str | None) -> None:
    """Count a failed authentication from `address`; raise AuthFailuresLimited when it is past
    the limit (the one that reaches it is still answered as the failure it is)."""
    most, window = _failure_limit()
    if address is None or not most:
        return
    now = time.time()
    index = int(now // window)
    if settings.REDIS_URL:
        counts = _counts([f"{settings.RUNTIME_DEPLOYMENT}:authfail:{index}:{address}"], window)
        if counts is None:  # Redis failed: fail open, as every limit here does
            return
        failures = counts[0]
    else:
        with _lock:
            failures = _local_failures[address, index] = _local_failures.get((address, index), 0) + 1
            if len(_local_failures) > _KEEP:
                for old in [k for k in _local_failures if k[1] < index]:
                    del _local_failures[old]
    if failures < most:
        return
    ends = (index + 1) * window
    with _lock:
        _refused_until[address] = ends
        if len(_refused_until) > _KEEP:
            for gone in [a for a, until in _refused_until.items() if until <= now]:
                del _refused_until[gone]
    if failures > most:
        raise AuthFailuresLimited(max(1, math.ceil(ends - now)))
