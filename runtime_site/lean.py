"""The lean path: a few GET endpoints read far more often than anything else — a task's
snapshot, its event stream, /healthz and /readyz — are answered on the event loop, with no
thread hop, no DRF and no ORM (issue 14: 50 pollers of one web process waited 1.35 s for a
snapshot and /healthz queued behind them).

A URL's view opts in by carrying a `lean` attribute: an async function `(request, **kwargs)`
that returns a response, or None to say "not mine to answer". None hands the request, as it
came, to the full handler (runtime_site/handlers.py), so a lean view only ever answers the
common case (a well-formed API key, allowed, and the thing found) and every other answer —
401, 403, 404, 405, a JWT, a session, hostile input — is the full path's own, word for word.
HEAD and other methods never come here.

What the middleware does is kept. LEAN_MIDDLEWARE says, for every entry of
settings.MIDDLEWARE, whether the lean path runs it (its request check, and its response
headers) or why a lean request does not need it. A middleware it does not know (tracing adds
one) switches the lean path off for the whole process: nothing is skipped unexamined. A
request any middleware would answer itself (a NUL in a header, a body over the limit, a
redirect) goes the full way too.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

from django.conf import settings
from django.core.exceptions import BadRequest, SuspiciousOperation
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.utils.log import log_response
from django.utils.module_loading import import_string

from runtime_site.middleware import scope_problem

logger = logging.getLogger(__name__)

LeanView = Callable[..., Awaitable[HttpResponseBase | None]]
Asgi = Callable[[dict[str, Any], Any, Any], Awaitable[None]]

RUN = "run"
LEAN_MIDDLEWARE: dict[str, str] = {
    "runtime_site.middleware.BodySizeLimitMiddleware": RUN,
    "runtime_site.middleware.UnsafeTextMiddleware": RUN,
    "django.middleware.security.SecurityMiddleware": RUN,
    "django.middleware.csp.ContentSecurityPolicyMiddleware": RUN,
    "whitenoise.middleware.WhiteNoiseMiddleware": "serves files under STATIC_URL only, where no lean view is",
    "django.contrib.sessions.middleware.SessionMiddleware": "a lean view never reads the session, so it adds "
    "nothing (a session-authenticated request is not a lean view's: it answers None)",
    "django.middleware.common.CommonMiddleware": RUN,
    "django.middleware.csrf.CsrfViewMiddleware": "GET is safe, and a lean view never uses the CSRF token, so "
    "no cookie is set",
    "django.contrib.auth.middleware.AuthenticationMiddleware": "sets a lazy request.user, which a lean view "
    "never reads (API keys are the views' own)",
    "django.contrib.messages.middleware.MessageMiddleware": "a lean view stores no message",
    "django.middleware.clickjacking.XFrameOptionsMiddleware": RUN,
    "axes.middleware.AxesMiddleware": "answers locked-out sign-ins only",
}


def lean(view: LeanView) -> Callable[[Any], Any]:
    """Decorator for a URL's (full) view: `view` answers its GETs on the lean path."""

    def mark(full: Any) -> Any:
        full.lean = view
        return full

    return mark


def _never(request: HttpRequest) -> HttpResponseBase:
    raise AssertionError("the lean path calls middleware hooks one by one, never the chain")


class LeanPath:
    def __init__(self) -> None:
        unknown = [name for name in settings.MIDDLEWARE if name not in LEAN_MIDDLEWARE]
        self.enabled = not unknown
        if unknown:
            logger.info("lean path off: middleware it has not been checked against: %s", ", ".join(unknown))
        self.middleware = [
            import_string(name)(_never) for name in settings.MIDDLEWARE if LEAN_MIDDLEWARE.get(name) == RUN
        ]

    async def __call__(
        self, scope: dict[str, Any], receive: Any, send: Any, view: LeanView, kwargs: dict[str, Any], full: Asgi
    ) -> None:
        request = _build(scope)
        if request is None:  # a request Django cannot build: the full handler's 400 names why
            return await full(scope, receive, send)
        try:
            response = None if self._request_checks(request) else await view(request, **kwargs)
        except Exception:
            # A bug of the lean view must not cost the client its answer; it is logged as one.
            logger.exception("lean view failed; the full handler answers instead")
            response = None
        if response is None:
            return await full(scope, receive, send)
        for middleware in reversed(self.middleware):
            if hasattr(middleware, "process_response"):
                response = middleware.process_response(request, response)
        if response.status_code >= 400:  # as Django's handler logs them (django.request)
            logged = cast(HttpResponse, response)  # log_response reads its status only
            log_response("%s: %s", response.reason_phrase, request.path, response=logged, request=request)
        await _send(response, receive, send)

    def _request_checks(self, request: HttpRequest) -> bool:
        """Whether a middleware would answer this request itself (then the full path does)."""
        for middleware in self.middleware:
            try:
                check = getattr(middleware, "check", None) or getattr(middleware, "process_request", None)
                if check is not None and check(request) is not None:
                    return True
            except Exception:  # noqa: BLE001 (a disallowed host, a forbidden user agent: the full path says so)
                return True
        return False


def _build(scope: dict[str, Any]) -> ASGIRequest | None:
    """The request, or None where the full handler refuses to build it (RequestCheckingHandler):
    a query string that is not UTF-8, a Content-Type past Django's length limit. Built here
    they raised out of the lean path, which uvicorn answered 500."""
    if scope_problem(scope) is not None:
        return None
    try:
        return ASGIRequest(scope, io.BytesIO())
    except (BadRequest, SuspiciousOperation):
        return None


class LeanStream(StreamingHttpResponse):
    """A lean view's stream of text chunks, sent as they come (UTF-8, without Django's
    per-chunk conversion: one stream event reaches hundreds of streams). `on_close` runs
    once it has ended, however it ended (the client went, the stream finished, or it never
    started); not response.close(), which sends request_finished and closes Django's
    connections: the lean path has none."""

    def __init__(self, chunks: AsyncIterator[str], *, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(chunks, **kwargs)
        self.chunks = chunks
        self.on_close = on_close


async def _send(response: HttpResponseBase, receive: Any, send: Any) -> None:
    headers = [(name.encode("ascii"), value.encode("latin1")) for name, value in response.items()]
    headers += [(b"Set-Cookie", cookie.OutputString().encode("ascii")) for cookie in response.cookies.values()]
    try:
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        if isinstance(response, LeanStream):
            await _stream(response, receive, send)
        else:
            await send({"type": "http.response.body", "body": response.content})  # type: ignore[attr-defined]
    finally:
        if isinstance(response, LeanStream):
            response.on_close()


async def _stream(response: LeanStream, receive: Any, send: Any) -> None:
    """Send the chunks of a stream as they come, until it ends or the client goes."""

    async def pump() -> None:
        async for chunk in response.chunks:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    pumping, watching = asyncio.ensure_future(pump()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (pumping, watching):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task
