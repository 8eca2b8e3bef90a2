from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from runtime_site.errors import error_body


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
