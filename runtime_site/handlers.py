"""The web process's ASGI handler: a sync view runs with its whole middleware chain in one
thread, an async view (/mcp) on the event loop.

Django's ASGIHandler runs the middleware chain in async mode: every MiddlewareMixin
(sessions, CSRF, auth, messages ...) hops to a thread for its process_request and again
for its process_response, and a sync middleware or view in between hops back. That is
some fifteen thread hops for one sync REST request, each a wake-up through the event loop
and a wait for the GIL: one web process served ~100 snapshot reads/s with 50 readers
queueing 0.5 s, and /healthz, which does nothing, took 4 ms idle (bench/api.py). Loaded
in sync mode, the chain is one hop: the request's thread runs every middleware and the
view in a row, as under WSGI.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.exceptions import BadRequest, SuspiciousOperation
from django.core.handlers import base
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpRequest, HttpResponseBase, JsonResponse
from django.urls import Resolver404, ResolverMatch, get_resolver

from runtime_site.errors import error_body, unsafe_input_body
from runtime_site.lean import LeanPath
from runtime_site.middleware import scope_problem


class RequestCheckingHandler(ASGIHandler):
    """ASGIHandler, except that a request Django cannot even build is a 400 in the one error
    shape. ASGIRequest parses the Content-Type's parameters in its constructor, and
    create_request only catches a bad encoding and a too-large body: a Content-Type over
    Django's length limit raised BadRequest out of the handler, which uvicorn answered 500.
    What the scope itself shows (middleware.scope_problem) is named before Django tries."""

    def create_request(self, scope: Mapping[str, Any], body_file: IO[bytes]) -> tuple[Any, Any]:
        if (problem := scope_problem(dict(scope))) is not None:
            return None, JsonResponse(unsafe_input_body(problem), status=400)
        try:
            return super().create_request(scope, body_file)
        except (BadRequest, SuspiciousOperation) as exc:
            return None, JsonResponse(error_body("bad_request", str(exc) or "bad request"), status=400)


class SyncChainHandler(RequestCheckingHandler):
    """ASGIHandler whose middleware chain is loaded for sync views and run in one hop."""

    def __init__(self) -> None:
        base.BaseHandler.__init__(self)
        self.load_middleware(is_async=False)

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        # thread_sensitive: the request's own thread (ASGIHandler's ThreadSensitiveContext),
        # the one request_started/request_finished close its database connection in.
        return await sync_to_async(self.get_response, thread_sensitive=True)(request)


class ByViewKind:
    """Sends each HTTP request to the handler for its view's kind: a GET whose view has a
    lean variant to the lean path (runtime_site/lean.py), async views (and anything not
    HTTP) to Django's own ASGIHandler, every other request to SyncChainHandler."""

    def __init__(self) -> None:
        self.async_handler = RequestCheckingHandler()
        self.sync_handler = SyncChainHandler()
        self.lean_path = LeanPath()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.async_handler(scope, receive, send)
        match = _resolve(scope)
        full = self.async_handler if match is not None and iscoroutinefunction(match.func) else self.sync_handler
        view = getattr(match.func, "lean", None) if match is not None and scope["method"] == "GET" else None
        if view is not None and self.lean_path.enabled:
            return await self.lean_path(scope, receive, send, view, match.kwargs, full)  # type: ignore[union-attr]
        await full(scope, receive, send)


def _resolve(scope: dict[str, Any]) -> ResolverMatch | None:
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    try:
        return get_resolver().resolve(path)
    except Resolver404:
        return None  # a 404 page, rendered by the sync chain


def _async_view(scope: dict[str, Any]) -> bool:
    match = _resolve(scope)
    return match is not None and iscoroutinefunction(match.func)
