"""POST /mcp: the HTTP edge. Origin, authentication, framing and the era of the request
here, with the dispatch table; the work in modern.py, legacy.py and shared.py (run in a
thread: the ORM is synchronous), and waiting for a task without holding a thread or a
database connection.

Answers are application/json, or a stream scoped to the request (text/event-stream)
when the answer waits on a task: keep-alive comments, notifications/progress for the
request's progressToken, then the response. A client that goes away only ends its own
request; it never cancels a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions

from common import json_safety
from mcp_server import legacy, modern
from mcp_server.protocol import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    META_SERVER,
    METHOD_NOT_FOUND,
    SERVER_INFO,
    SERVICE_UNAVAILABLE,
    Message,
    RpcError,
    parse,
    request_id_of,
    result_body,
    validate_modern,
)
from mcp_server.shared import Call, Wait, ping, rpc_error
from runtime_site.errors import RETRY_AFTER_SECONDS, allow_methods, infrastructure_fault
from runtime_site.middleware import check_texts, not_utf8
from runtime_site.ratelimit import RateLimited
from tasks_app import oauth
from tasks_app.auth import (
    ApiKeyAuthentication,
    Principal,
    bearer_token,
    challenge,
    reauthenticate,
    scope_challenge,
)
from tasks_app.errors import DomainError
from tasks_app.models import Task
from tasks_app.streams import wakeups

logger = logging.getLogger(__name__)

LOCAL_HOSTS = {"localhost", "127.0.0.1", "[::1]", "::1"}
KEEP_ALIVE_SECONDS = 10.0
# A waiting request looks at its task when the task publishes an event, and besides at a
# growing interval (Redis is a hint; without it these looks are all there is).
LOOK_FIRST_SECONDS, LOOK_LONGEST_SECONDS = 0.02, 0.25
LISTEN_POLL_SECONDS = 0.25
META_SUBSCRIPTION = "io.modelcontextprotocol/subscriptionId"
TERMINAL_MCP = frozenset({"completed", "failed", "cancelled"})
SERVER_ERROR = -32000  # implementation-defined: authentication and origin refusals
SESSION_HEADER = "Mcp-Session-Id"
RATE_LIMITED = -32029  # implementation-defined: HTTP 429, retry after Retry-After (runtime_site/ratelimit.py)
RETRY = {"Retry-After": str(RETRY_AFTER_SECONDS)}


def unavailable(cause: str) -> RpcError:
    """-32003 for an infrastructure fault (runtime_site.errors.infrastructure_fault), naming
    its cause: HTTP 503 with Retry-After, or a waiting answer's last message."""
    return RpcError(SERVICE_UNAVAILABLE, f"Service unavailable: {cause}; retry shortly")


def fault_of(exc: Exception) -> RpcError | None:
    """unavailable() for an infrastructure fault, None for anything else (a bug: -32603)."""
    cause = infrastructure_fault(exc)
    return None if cause is None else unavailable(cause)


# The dispatch tables: one handler per method and wire (modern.py, legacy.py, shared.py).
MODERN_METHODS: dict[str, Callable[[Call], Any]] = {
    "server/discover": modern.discover,
    "tools/list": modern.modern_tools_list,
    "tools/call": modern.modern_tools_call,
    "tasks/get": modern.modern_tasks_get,
    "tasks/update": modern.modern_tasks_update,
    "tasks/cancel": modern.modern_tasks_cancel,
    "prompts/list": modern.empty_list("prompts"),
    "resources/list": modern.empty_list("resources"),
    "resources/templates/list": modern.empty_list("resourceTemplates"),
    "resources/read": modern.resources_read,
    "subscriptions/listen": modern.subscriptions_listen,
}

LEGACY_METHODS: dict[str, Callable[[Call], Any]] = {
    "initialize": legacy.initialize,
    "ping": ping,
    "tools/list": legacy.legacy_tools_list,
    "tools/call": legacy.legacy_tools_call,
    "tasks/get": legacy.legacy_tasks_get,
    "tasks/result": legacy.legacy_tasks_result,
    "tasks/list": legacy.legacy_tasks_list,
    "tasks/cancel": legacy.legacy_tasks_cancel,
}


def dispatch(call: Call) -> dict[str, Any] | Wait | modern.Listen:
    table = MODERN_METHODS if call.message.modern else LEGACY_METHODS
    handler = table.get(call.message.method or "")
    if handler is None:
        raise RpcError(METHOD_NOT_FOUND, f"Method not found: {call.message.method}")
    return handler(call)


def _error(
    exc: RpcError, request_id: Any = None, *, status: int | None = None, headers: dict[str, str] | None = None
) -> JsonResponse:
    return JsonResponse(exc.body(request_id), status=status or exc.http_status, headers=headers)


# What a browser sends as Origin for a web page: scheme://host[:port], nothing else.
WEB_ORIGIN = re.compile(r"^https?://[^/?#@\s]+\Z")


def _origin_allowed(request: HttpRequest) -> bool:
    """DNS-rebinding guard: a browser Origin must be local, the server itself, or configured.
    Anything that is no web page's origin ("null", a file or an extension, userinfo, a path,
    a port or an address that does not parse) is refused, not guessed at. "The server
    itself" trusts the Host header, so only when ALLOWED_HOSTS vouched for it: under DNS
    rebinding the attacker names both, and "*" lets any name through."""
    origin = request.headers.get("Origin")
    if not origin:
        return True
    if origin in settings.RUNTIME_MCP_ALLOWED_ORIGINS:
        return True
    if not WEB_ORIGIN.match(origin):
        return False
    try:
        parts = urlsplit(origin)
        host, _ = parts.hostname or "", parts.port  # .port raises on one out of range
    except ValueError:
        return False
    if host in LOCAL_HOSTS or f"[{host}]" in LOCAL_HOSTS:
        return True
    if "*" in settings.ALLOWED_HOSTS:
        return False
    return parts.netloc.lower() == request.get_host().lower()


def _authenticate(request: HttpRequest) -> Principal | None:
    try:
        found = ApiKeyAuthentication().authenticate(request)  # reads only request.META
    finally:
        connection.close()
    return found[1] if found else None


def _run(call: Call) -> dict[str, Any] | Wait | modern.Listen:
    try:
        return dispatch(call)
    finally:
        connection.close()


def _poll(wait: Wait, timed_out: bool) -> tuple[dict[str, Any] | None, float, list[dict[str, Any]]]:
    """One look at the task: (the answer if done or timed out, else None; its progress;
    requests to send the client meanwhile)."""
    try:
        task = Task.objects.get(id=wait.task_id)
        if wait.done(task) or timed_out:
            return wait.render(task, timed_out), task.progress, []
        return None, task.progress, wait.ask(task) if wait.ask else []
    finally:
        connection.close()


def _answer(principal: Principal, message: Message) -> bool:
    try:
        return legacy.legacy_input_response(Call(principal, message))
    finally:
        connection.close()


def _with_server_info(message: Message, result: dict[str, Any]) -> dict[str, Any]:
    if not message.modern:
        return result
    return {**result, "_meta": {**(result.get("_meta") or {}), META_SERVER: SERVER_INFO}}


def _sse(payload: dict[str, Any]) -> str:
    return f"event: message\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


REVOKED = RpcError(SERVER_ERROR, "Unauthorized: the credential this request came with no longer works")


class OpenWaits:
    """How many answers that wait each key holds open in this process (limits.mcp_streams_per_key:
    past it, a new listen or blocking tasks/result is 429).

    The request rate limit counts a wait once, when it opens, but it then looks at the
    database several times a second for as long as it lasts: a key opening its allowance of
    listens every minute would pile up thousands of them. Taken on the event loop, given
    back from Django's close() on a thread as well: hence the lock."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}
        self.lock = threading.Lock()

    def full(self, principal: Principal) -> bool:
        cap = int(settings.RUNTIME.get("limits", {}).get("mcp_streams_per_key", 0) or 0)
        return bool(cap) and self.open.get(principal.key or principal.actor, 0) >= cap

    def take(self, principal: Principal) -> None:
        key = principal.key or principal.actor
        with self.lock:
            self.open[key] = self.open.get(key, 0) + 1

    def give_back(self, principal: Principal) -> None:
        key = principal.key or principal.actor
        with self.lock:
            if (left := self.open.get(key, 0) - 1) > 0:
                self.open[key] = left
            else:
                self.open.pop(key, None)


class WaitStream(StreamingHttpResponse):
    """A waiting answer's stream, whose key's place (OpenWaits) is given back when Django
    closes the response: always, however the stream ended or if it never started."""

    def __init__(self, *args: Any, principal: Principal, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.principal: Principal | None = principal

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.principal is not None:
                OPEN_WAITS.give_back(self.principal)
                self.principal = None


OPEN_WAITS = OpenWaits()
STREAMS_RETRY_AFTER = 5  # seconds: a wait of the key's has to end first; there is no window to name
# The reads whose answer may wait without end (until the tasks finish): refused past the cap.
# The others that wait (a synchronous tools/call, a legacy cancel) are bounded and count only.
UNBOUNDED_WAITS = frozenset({"subscriptions/listen", "tasks/result"})


class Recheck:
    """An answer that waits (subscriptions/listen, a blocking tasks/result, a synchronous
    tools/call) outlives its request's authentication: like an SSE stream, it asks again every
    stream.auth_recheck_seconds whether its credential still speaks for its tenant, and ends
    with REVOKED when not, before it hands a revoked key anything more; with unavailable()
    (-32003, naming the cause) when the database or the token's issuer cannot tell (down, or
    frozen past RUNTIME_DB_QUERY_SECONDS), as the wait's own look at its tasks does: raised
    out of the stream, that cut it after its headers with no answer at all."""

    def __init__(self, request: HttpRequest, principal: Principal) -> None:
        self.token, self.tenant_id = bearer_token(request), principal.tenant.pk
        self.every = float(settings.RUNTIME["stream"].get("auth_recheck_seconds", 5))
        self.due = time.monotonic() + self.every

    async def refusal(self) -> RpcError | None:
        """REVOKED or unavailable() when the wait must end with it; None: it goes on."""
        if time.monotonic() < self.due:
            return None
        self.due = time.monotonic() + self.every
        try:
            still = await sync_to_async(self._still)()
        except Exception as exc:
            if (fault := fault_of(exc)) is None:  # a bug: ends the wait with an answer, not a cut stream
                logger.exception("mcp: rechecking a waiting answer's credential failed")
                return RpcError(INTERNAL_ERROR, "Internal error")
            logger.warning("mcp: cannot recheck a waiting answer's credential: %s", fault.message)
            return fault
        return None if still else REVOKED

    def _still(self) -> bool:
        try:
            who = reauthenticate(self.token) if self.token else None
            return who is not None and who.tenant.pk == self.tenant_id
        finally:
            connection.close()


async def _waited(message: Message, wait: Wait, recheck: Recheck) -> AsyncIterator[dict[str, Any] | None]:
    """Yields progress notifications and server requests (dicts) and None as keep-alive
    ticks, then the response. Looks at the task again when it publishes an event (its
    terminal one ends most waits), and at a growing interval whatever happens: the wakeup
    comes through Redis, a hint; the database is the truth."""
    with wakeups.waiting_for(wait.task_id) as woken:
        async for item in _waiting(message, wait, woken, recheck):
            yield item


async def _waiting(
    message: Message, wait: Wait, woken: asyncio.Event, recheck: Recheck
) -> AsyncIterator[dict[str, Any] | None]:
    started, last_tick, last_progress, interval = time.monotonic(), time.monotonic(), None, LOOK_FIRST_SECONDS
    while True:
        woken.clear()  # before the look: an event published during it wakes the next wait
        if (refused := await recheck.refusal()) is not None:
            yield refused.body(message.id)
            return
        timed_out = wait.seconds is not None and time.monotonic() - started >= wait.seconds
        try:
            answer, progress, requests = await sync_to_async(_poll)(wait, timed_out)
        except RpcError as exc:
            yield exc.body(message.id)
            return
        except Exception as exc:
            if (fault := fault_of(exc)) is not None:
                logger.warning("mcp: waiting for task %s: %s", wait.task_id, fault.message)
                yield fault.body(message.id)
                return
            logger.exception("mcp: waiting for task %s failed", wait.task_id)
            yield RpcError(INTERNAL_ERROR, "Internal error").body(message.id)
            return
        if answer is not None:
            yield result_body(message.id, _with_server_info(message, answer))
            return
        for server_request in requests:
            yield server_request
        if wait.progress_token is not None and progress != last_progress and progress > 0:
            last_progress = progress
            yield {
                "jsonrpc": "2.0",
                "method": "notifications/progress",
                "params": {"progressToken": wait.progress_token, "progress": progress, "total": 1.0},
            }
        if time.monotonic() - last_tick >= KEEP_ALIVE_SECONDS:
            last_tick = time.monotonic()
            yield None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(woken.wait(), interval)
        interval = min(interval * 1.2, LOOK_LONGEST_SECONDS)


def _listen_poll(listen: modern.Listen) -> list[dict[str, Any]]:
    try:
        return listen.tasks()
    finally:
        connection.close()


async def _listened(message: Message, listen: modern.Listen, recheck: Recheck) -> AsyncIterator[dict[str, Any] | None]:
    """subscriptions/listen: the ack first, then notifications/tasks (a full DetailedTask)
    for each subscribed task now and whenever its status or open questions change. The
    database is the only source, so a change made by any worker shows. Ends with the
    listen result once every subscribed task is terminal (nothing more can change)."""
    meta = {META_SUBSCRIPTION: message.id}
    yield {
        "jsonrpc": "2.0",
        "method": "notifications/subscriptions/acknowledged",
        "params": {"notifications": listen.acknowledged, "_meta": meta},
    }
    seen: dict[str, tuple[str, tuple[str, ...]]] = {}
    last_tick = time.monotonic()
    while True:
        if (refused := await recheck.refusal()) is not None:
            yield refused.body(message.id)
            return
        if "taskIds" in listen.acknowledged:  # else nothing we honour was asked: keep-alives only
            try:
                tasks = await sync_to_async(_listen_poll)(listen)
            except Exception as exc:
                if (fault := fault_of(exc)) is not None:
                    logger.warning("mcp: listening to tasks: %s", fault.message)
                    yield fault.body(message.id)
                    return
                logger.exception("mcp: listening to tasks failed")
                yield RpcError(INTERNAL_ERROR, "Internal error").body(message.id)
                return
            for task in tasks:
                mark = (task["status"], tuple(sorted(task.get("inputRequests", {}))))
                if seen.get(task["taskId"]) != mark:
                    seen[task["taskId"]] = mark
                    yield {"jsonrpc": "2.0", "method": "notifications/tasks", "params": {**task, "_meta": meta}}
            if all(task["status"] in TERMINAL_MCP for task in tasks):
                yield result_body(message.id, _with_server_info(message, {"resultType": "complete", "_meta": meta}))
                return
        if time.monotonic() - last_tick >= KEEP_ALIVE_SECONDS:
            last_tick = time.monotonic()
            yield None
        await asyncio.sleep(LISTEN_POLL_SECONDS if "taskIds" in listen.acknowledged else 1.0)


def _respond_wait(
    request: HttpRequest, message: Message, wait: Wait | modern.Listen, recheck: Recheck, principal: Principal
) -> HttpResponseBase:
    async def stream() -> AsyncIterator[str]:
        yield ": waiting for the task\n\n"
        items = (
            _listened(message, wait, recheck) if isinstance(wait, modern.Listen) else _waited(message, wait, recheck)
        )
        async for item in items:
            yield ": keep-alive\n\n" if item is None else _sse(item)

    response = WaitStream(stream(), content_type="text/event-stream", principal=principal)
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


async def _respond_wait_json(request: HttpRequest, message: Message, wait: Wait, recheck: Recheck) -> HttpResponse:
    async for item in _waited(message, wait, recheck):
        if item is not None and "method" not in item:
            if item.get("error", {}).get("code") == SERVICE_UNAVAILABLE:
                return JsonResponse(item, status=503, headers=RETRY)
            if item.get("error", {}).get("message") == REVOKED.message:
                revoked = exceptions.AuthenticationFailed(REVOKED.message)
                return JsonResponse(item, status=401, headers={"WWW-Authenticate": challenge(request, revoked)})
            status = 200 if "result" in item or not message.modern else 500
            return JsonResponse(item, status=status)
    raise AssertionError("unreachable: _waited always ends with a response")


@csrf_exempt
async def mcp_endpoint(request: HttpRequest) -> HttpResponseBase:
    try:
        return await _endpoint(request)
    except Exception as exc:  # an infrastructure fault: a JSON-RPC answer the client may retry, not a 500
        if (fault := fault_of(exc)) is None:
            raise
        logger.warning("mcp: %s", fault.message, exc_info=True)
        return _error(fault, request_id_of(request.body), headers=RETRY)


async def _endpoint(request: HttpRequest) -> HttpResponseBase:
    if request.method == "OPTIONS":  # what it takes, as every other edge answers (errors.allow_methods)
        return HttpResponse(status=200, headers={"Allow": "POST, OPTIONS"})
    if request.method != "POST":  # no GET stream of server messages, no DELETE of a session: the spec lets both be 405s
        return _error(
            RpcError(INVALID_REQUEST, "Method Not Allowed: this endpoint accepts POST only"),
            status=405,
            headers={"Allow": "POST, OPTIONS"},
        )
    if not _origin_allowed(request):
        return _error(RpcError(SERVER_ERROR, "Forbidden: Origin not allowed"), status=403)
    if len(request.body) > settings.RUNTIME_MAX_BODY_BYTES:
        return _error(RpcError(INVALID_REQUEST, "Request body too large"), status=413)
    refusal: Exception | None = None  # why a credential that came was refused (auth.challenge)
    try:
        principal = await sync_to_async(_authenticate)(request)
    except oauth.TokenForbidden as exc:  # a good token that grants nothing here
        return _error(
            RpcError(SERVER_ERROR, f"Forbidden: {exc.detail}"),
            request_id_of(request.body),
            status=403,
            headers={"WWW-Authenticate": challenge(request, exc)},
        )
    except oauth.IssuerUnavailable as exc:  # not the token's fault: the client keeps it and retries
        return _error(
            RpcError(SERVICE_UNAVAILABLE, f"Service unavailable: {exc.detail}"),
            request_id_of(request.body),
            headers={"Retry-After": str(exc.wait)},
        )
    except exceptions.AuthenticationFailed as exc:
        principal, reason, refusal = None, str(exc.detail), exc
    except RateLimited as exc:  # the JSON-RPC twin of REST's 429
        return _error(
            RpcError(RATE_LIMITED, f"Too Many Requests: {exc.detail}"),
            request_id_of(request.body),
            status=429,
            headers={"Retry-After": str(exc.wait)},
        )
    else:
        reason = "Authorization: Bearer <api key or access token> is required"
    if principal is None:
        # WWW-Authenticate names the protected resource metadata (RFC 9728): where an MCP
        # client learns which authorization server issues tokens for this server.
        return _error(
            RpcError(SERVER_ERROR, f"Unauthorized: {reason}"),
            request_id_of(request.body),
            status=401,
            headers={"WWW-Authenticate": challenge(request, refusal)},
        )
    if (media_type := (request.content_type or "").lower()) != "application/json":
        # JSON-RPC over HTTP is application/json (the transport's POST): a form, text or no
        # Content-Type at all is not a message, however its bytes happen to read.
        said = f"Content-Type {media_type[:100]!r}" if media_type else "no Content-Type"
        return _error(
            RpcError(INVALID_REQUEST, f"Unsupported Media Type: {said}; /mcp takes application/json"),
            request_id_of(request.body),
            status=415,
        )
    headers = {key.lower(): value for key, value in request.headers.items()}
    try:
        message = parse(request.body, headers)
    except RpcError as exc:
        return _error(exc, exc.request_id, status=400)
    try:  # what UnsafeTextMiddleware checks on every other path, answered here with the id
        check_texts(request)
    except json_safety.UnsafeInput as exc:
        return _error(RpcError(INVALID_REQUEST, f"Invalid Request: {exc}"), message.id, status=400)
    if (charset := not_utf8(request)) is not None:
        said = f"Content-Type: charset {charset[:100]!r}: /mcp reads UTF-8 only; send UTF-8"
        return _error(RpcError(INVALID_REQUEST, f"Invalid Request: {said}"), message.id, status=415)
    if message.is_response:  # the answer to an elicitation/create sent on a tasks/result stream
        try:
            known = await sync_to_async(_answer)(principal, message)
        except RpcError as exc:
            return _error(exc, status=exc.http_status)
        except DomainError as exc:  # not this caller's to answer (an approval without the approve scope)
            refused = rpc_error(exc)
            return _error(refused, status=refused.http_status)
        except Exception as exc:
            if fault_of(exc) is not None:
                raise  # mcp_endpoint's -32003
            logger.exception("mcp: recording the answer to %s failed", message.id)
            return _error(RpcError(INTERNAL_ERROR, "Internal error"), status=500)
        if not known:
            return _error(
                RpcError(INVALID_REQUEST, "Invalid Request: not a response to a request this server sent you"),
                status=400,
            )
        return HttpResponse(status=202)
    try:
        if message.modern:
            validate_modern(message, headers)
    except RpcError as exc:
        return _error(exc, message.id)
    if message.is_notification:
        return HttpResponse(status=202)
    if message.method in UNBOUNDED_WAITS and OPEN_WAITS.full(principal):
        # Refused before anything is done (these only read); the waits already open go on.
        return _error(
            RpcError(RATE_LIMITED, "Too Many Requests: this key holds as many waiting answers open as it may"),
            message.id,
            status=429,
            headers={"Retry-After": str(STREAMS_RETRY_AFTER)},
        )
    try:
        outcome = await sync_to_async(_run)(Call(principal, message))
    except RpcError as exc:
        # On the 2025 wire a handler's error is an ordinary JSON-RPC answer (HTTP 200).
        return _error(exc, message.id, status=None if message.modern else 200)
    except json_safety.UnsafeInput as exc:  # an action's last check (parse() already refused the body's)
        return _error(rpc_error(exc), message.id)
    except DomainError as exc:  # an action refused (tasks_app.errors): as a handler's own error
        if not message.modern:
            return _error(rpc_error(exc), message.id, status=200)
        # A 403 that a token with more scope would lift says which (MCP's scope challenge).
        step_up = scope_challenge(request, principal, exc)
        return _error(rpc_error(exc), message.id, headers={"WWW-Authenticate": step_up} if step_up else None)
    except Exception as exc:
        if fault_of(exc) is not None:
            raise  # mcp_endpoint's -32003
        logger.exception("mcp: %s failed", message.method)
        return _error(RpcError(INTERNAL_ERROR, "Internal error"), message.id)
    if isinstance(outcome, modern.Listen | Wait):
        OPEN_WAITS.take(principal)  # given back when the answer ends, however it ends
    if isinstance(outcome, modern.Listen):  # always a stream: it is nothing else
        return _respond_wait(request, message, outcome, Recheck(request, principal), principal)
    if isinstance(outcome, Wait):
        if "text/event-stream" in request.headers.get("Accept", ""):
            return _respond_wait(request, message, outcome, Recheck(request, principal), principal)
        try:
            return await _respond_wait_json(request, message, outcome, Recheck(request, principal))
        finally:
            OPEN_WAITS.give_back(principal)
    response = JsonResponse(result_body(message.id, _with_server_info(message, outcome)))
    if not message.modern and message.method == "initialize":
        # Signed, never stored: carries the client's capabilities to later requests.
        response[SESSION_HEADER] = await sync_to_async(legacy.legacy_session)(Call(principal, message))
    return response


@allow_methods("GET", "HEAD")  # a public read: no session, nothing to forge
def protected_resource_metadata(request: HttpRequest) -> HttpResponse:
    """GET /.well-known/oauth-protected-resource[/mcp] (RFC 9728): this server's resource
    identifier, the issuer whose tokens it takes, its scopes. Public, as the RFC wants."""
    response = JsonResponse(oauth.metadata(request))
    response["Cache-Control"] = "public, max-age=300"
    return response
