from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from common import json_safety
from runtime_site.errors import error_body, unsafe_input_body


class BodySizeLimitMiddleware:
    """Refuse oversized API bodies with a 413 before anything parses them."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = settings.RUNTIME_MAX_BODY_BYTES
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return JsonResponse(error_body("invalid_request", "malformed Content-Length"), status=400)
        if length > limit:
            return JsonResponse(
                error_body("body_too_large", f"request body is {length} bytes; the limit is {limit}"), status=413)
        return self.get_response(request)


def request_texts(request: HttpRequest) -> dict[str, Any]:
    """Everything a request carries besides its body, for json_safety.check(): its path,
    every query parameter and every header (cookies included)."""
    return {"path": request.path, "query": {key: request.GET.getlist(key) for key in request.GET},
            "headers": dict(request.headers)}


class UnsafeTextMiddleware:
    """A NUL in the path, a query parameter or a header is a 400 naming where, before any
    view or middleware queries with it (PostgreSQL refuses it wherever it lands: a session
    cookie, an input key in the URL, a status filter). The body is the parsers' to check.
    /mcp answers in JSON-RPC, with the request's id, so it checks request_texts() itself."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path != "/mcp":
            try:
                json_safety.check(request_texts(request))
            except json_safety.UnsafeInput as exc:
                return JsonResponse(unsafe_input_body(exc), status=400)
        return self.get_response(request)
