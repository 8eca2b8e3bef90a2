"""Request rates per API key and per tenant on each surface (REST, SSE connects, /mcp),
counted in Redis so every web process shares one count (config/runtime.yaml `limits`).

A fixed window per surface: one INCR per counter, in one round trip, and the window's end is
the Retry-After. A limit is a guard against floods and runaway clients, not billing, so an
infrastructure error fails open: Redis down or slow never turns a request into a 500 and
never holds it up. The request goes through, one warning is logged, and Redis is left alone
for a few seconds so a dead server costs no timeout per request.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING

import redis
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
    global _skip_until  # noqa: PLW0603 (one process-wide back-off after a Redis failure)
    if time.monotonic() < _skip_until:
        return None
    try:
        pipe = _client(settings.REDIS_URL).pipeline(transaction=False)
        for key in keys:
            pipe.incr(key)
            pipe.expire(key, window + 1, nx=True)
        return pipe.execute()[::2]
    except redis.RedisError as exc:
        _skip_until = time.monotonic() + BACKOFF_SECONDS
        logger.warning(
            "rate limits not enforced for %.0f s: Redis failed (%s: %s); requests are let through",
            BACKOFF_SECONDS,
            type(exc).__name__,
            exc,
        )
        return None


def enforce(principal: Principal, surface: str) -> None:
    """Count this request against its key and its tenant; raise RateLimited past either."""
    limits = settings.RUNTIME.get("limits", {})
    per_key, per_tenant = limits.get(f"{surface}_per_key", 0), limits.get(f"{surface}_per_tenant", 0)
    if not (per_key or per_tenant) or not settings.REDIS_URL or principal.key is None:
        return  # no limit configured, or the embedded profile (no Redis): see docs/operations.md
    window = max(1, int(limits.get("window_seconds", 60)))
    now = time.time()
    slot = int(now // window)
    prefix = f"{settings.RUNTIME_DEPLOYMENT}:ratelimit:{surface}:{slot}"
    counts = _counts([f"{prefix}:key:{principal.key}", f"{prefix}:tenant:{principal.tenant.pk}"], window)
    if counts is None:
        return
    wait = max(1, math.ceil((slot + 1) * window - now))
    if per_key and counts[0] > per_key:
        raise RateLimited(wait, "key")
    if per_tenant and counts[1] > per_tenant:
        raise RateLimited(wait, "tenant")
