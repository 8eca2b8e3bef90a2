from __future__ import annotations

import codecs
import json
import re
from collections import Counter
from collections.abc import Callable
from functools import cache
from typing import Any
from urllib.parse import unquote_to_bytes

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import reverse

from common import json_safety
from runtime_site.errors import error_body, unsafe_input_body


class BodySizeLimitMiddleware:
    """Refuse oversized API bodies with a 413 before anything parses them."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.check(request) or self.get_response(request)

    @staticmethod
    def check(request: HttpRequest) -> HttpResponse | None:
        """The refusal, or None (also the lean path's check: runtime_site/lean.py)."""
        limit = settings.RUNTIME_MAX_BODY_BYTES
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return JsonResponse(error_body("invalid_request", "malformed Content-Length"), status=400)
        if length > limit:
            return JsonResponse(
                error_body("body_too_large", f"request body is {length} bytes; the limit is {limit}"), status=413
            )
        return None


FORM = "application/x-www-form-urlencoded"
# "%" starts a percent-encoding only before two hex digits (RFC 3986 §2.1).
_BAD_PERCENT = re.compile(rb"%(?![0-9A-Fa-f]{2})")


def check_texts(request: HttpRequest) -> None:
    """UnsafeInput for the first thing a request carries besides a JSON body that no view may
    read as it came: a query string or a form body that is not well-formed percent-encoding,
    or anything request_texts() holds that is never stored (json_safety.check)."""
    query = request.META.get("QUERY_STRING", "").encode()
    if (problem := malformed_encoding(query, "query")) is not None:
        raise problem
    if request.content_type == FORM:
        charset = (request.content_params or {}).get("charset", "utf-8")
        if unknown_charset(request) is None and (problem := malformed_encoding(request.body, "form", charset)):
            raise problem
    json_safety.check(request_texts(request))


def malformed_encoding(data: bytes, where: str, charset: str = "utf-8") -> json_safety.UnsafeInput | None:
    """The first name or value of `data` (name=value&..., a query string or a form body) whose
    percent-encoding is broken ("%zz", a lone "%") or does not decode in `charset` ("%ff" in
    UTF-8), named where.name. Django read "%zz" as it came and "%ff" as U+FFFD, so a view went
    on with a value the client never sent."""
    label = "UTF-8" if codecs.lookup(charset).name == "utf-8" else charset
    for pair in data.split(b"&"):
        name, _, value = pair.partition(b"=")
        shown = f"{where}.{unquote_to_bytes(name.replace(b'+', b' ')).decode(charset, 'replace')}"
        for part in (name, value):
            if _BAD_PERCENT.search(part):
                return json_safety.UnsafeInput(
                    shown, 'has a "%" that starts no percent-encoding (% and two hex digits; %25 for "%" itself)'
                )
            try:
                unquote_to_bytes(part.replace(b"+", b" ")).decode(charset)
            except UnicodeError:
                return json_safety.UnsafeInput(shown, f"is not {label} once its percent-encoding is decoded")
    return None


# Headers that hold one value (RFC 9110 §5.3: only a list-valued field may be sent twice).
# Django joins a header sent twice with a comma: two Authorization headers read as one
# malformed key (a 401 blaming the key), two Idempotency-Keys as the key "a,b", two
# Content-Types as "application/json,application/json" (a 415); a proxy or client that
# sends two means two different things, and no server may pick one.
SINGLE_VALUE_HEADERS = frozenset(
    {
        b"authorization",
        b"content-length",
        b"content-type",
        b"host",
        b"idempotency-key",
        b"last-event-id",
        b"mcp-method",
        b"mcp-name",
        b"mcp-protocol-version",
        b"mcp-session-id",
        b"origin",
    }
)


def scope_problem(scope: dict[str, Any]) -> json_safety.UnsafeInput | None:
    """What in an ASGI request's scope makes it one Django cannot build as it came, named: a
    single-value header sent more than once (the scope still lists each), or a query string
    whose raw bytes are not UTF-8 (ASGIRequest decodes it in its constructor, and a
    UnicodeDecodeError was Django's empty text/html 400, or out of the lean path a 500).
    Both handlers read it before building a request (runtime_site/handlers.py, lean.py)."""
    counts = Counter(name.lower() for name, _ in scope.get("headers", ()) if name.lower() in SINGLE_VALUE_HEADERS)
    for name, count in counts.items():
        if count > 1:
            return json_safety.UnsafeInput(f"headers.{name.decode().title()}", f"given {count} times; send it once")
    try:
        scope.get("query_string", b"").decode("utf-8")
    except UnicodeDecodeError:
        return json_safety.UnsafeInput("query", "is not UTF-8; percent-encode any other byte (%xx)")
    return None


def request_texts(request: HttpRequest) -> dict[str, Any]:
    """Everything a request carries besides its body, for json_safety.check(): its path,
    every query parameter and every header (cookies included)."""
    return {
        "path": request.path,
        "query": {key: request.GET.getlist(key) for key in request.GET},
        "headers": dict(request.headers),
    }


def repeated_parameter(request: HttpRequest) -> json_safety.UnsafeInput | None:
    """A query parameter given more than once: every view reads one value of each (the last),
    so ?status=a&status=b or ?limit=1&limit=2 was answered for one of them, the other
    ignored. The admin's own filters take several values of one parameter; not ours to judge."""
    if request.path.startswith(_admin_prefix()):
        return None
    for name in request.GET:
        if (count := len(request.GET.getlist(name))) > 1:
            return json_safety.UnsafeInput(f"query.{name}", f"given {count} times; give it once")
    return None


@cache
def _admin_prefix() -> str:
    return reverse("admin:index")


def unknown_charset(request: HttpRequest) -> str | None:
    """The charset a body's Content-Type names when no codec has that name. Django drops such
    a charset and reads the body as UTF-8, so the request went on as if it had said nothing."""
    charset = (request.content_params or {}).get("charset")
    if charset is None:
        return None
    try:
        codecs.lookup(charset)
    except LookupError:
        return charset
    return None


def not_utf8(request: HttpRequest) -> str | None:
    """The charset a body's Content-Type names unless it is UTF-8. /mcp reads its JSON-RPC
    as UTF-8 (JSON between systems is UTF-8: RFC 8259 §8.1), whatever the header said: a
    body said to be rot13, punycode or Latin-1 was read as UTF-8 all the same."""
    charset = (request.content_params or {}).get("charset")
    if charset is None:
        return None
    try:
        return None if codecs.lookup(charset).name == "utf-8" else charset
    except LookupError:
        return charset


def charset_refusal(charset: str) -> str:
    return f"Content-Type: charset {charset[:100]!r} is not a character set this server knows; send UTF-8"


class UnsafeTextMiddleware:
    """A NUL in the path, a query parameter or a header is a 400 naming where, before any
    view or middleware queries with it (PostgreSQL refuses it wherever it lands: a session
    cookie, an input key in the URL, a status filter); so is a query parameter given twice,
    and a body's charset nobody knows is a 415; so is a query string or a form body whose
    percent-encoding is broken (check_texts). A JSON body is the parsers' to check. /mcp
    answers in JSON-RPC, with the request's id, so it calls check_texts() itself."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.check(request) or self.get_response(request)

    @staticmethod
    def check(request: HttpRequest) -> HttpResponse | None:
        """The refusal, or None (also the lean path's check: runtime_site/lean.py)."""
        if request.path != "/mcp":
            try:
                check_texts(request)
            except json_safety.UnsafeInput as exc:
                return JsonResponse(unsafe_input_body(exc), status=400)
            if (repeated := repeated_parameter(request)) is not None:
                return JsonResponse(unsafe_input_body(repeated), status=400)
            if (charset := unknown_charset(request)) is not None:
                return JsonResponse(error_body("unsupported_media_type", charset_refusal(charset)), status=415)
        return None


class ChunkedBodyASGI:
    """ASGI, around Django: a body sent without a Content-Length (Transfer-Encoding: chunked)
    is read here, up to the limit, and handed on with its length declared. Django reads any
    such body whole (spooled to disk) before BodySizeLimitMiddleware sees it, and DRF reads
    a body with no Content-Length as empty: a chunked create was "agent: required", a
    chunked 5 MB /mcp call was parsed. Beyond the limit it is the same 413."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = settings.RUNTIME_MAX_BODY_BYTES
        # A body declared too large is refused before a byte of it is read: Django's handler
        # reads any body whole (spooled to disk) before BodySizeLimitMiddleware runs, so a
        # client announcing and sending gigabytes filled the disk to be told 413.
        # (uvicorn refuses a Content-Length that is not a number, or one beside Transfer-Encoding.)
        declared = [value for name, value in scope["headers"] if name == b"content-length"]
        if declared and declared[0].isdigit() and int(declared[0]) > limit:
            return await self._too_large(send, limit)
        # Without Transfer-Encoding and Content-Length a request has no body (RFC 9112 §6.3).
        if not any(name == b"transfer-encoding" for name, _ in scope["headers"]):
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await self._too_large(send, limit)
        headers = [*scope["headers"], (b"content-length", str(len(body)).encode())]
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()  # after the body: the disconnect, for streams
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app({**scope, "headers": headers}, replay, send)

    @staticmethod
    async def _too_large(send: Any, limit: int) -> None:
        payload = json.dumps(error_body("body_too_large", f"request body is over the limit of {limit} bytes")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
