"""One error shape everywhere: {"error": {"code", "message", "fields"?}}.

Domain exceptions are mapped to HTTP here, by the one table every edge reads
(tasks_app.errors.DOMAIN_ERRORS); actions never build responses.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.http.response import HttpResponseBase
from django.urls import URLResolver
from django.views.decorators.csrf import csrf_exempt, csrf_protect
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_handler

from common import json_safety
from tasks_app import access, errors, oauth
from tasks_app.auth import Principal, challenge, scope_challenge
from tasks_app.errors import AnswerConflict, CommandRefused, VersionConflict
from tasks_app.faults import infrastructure_fault
from tasks_app.selectors import task_snapshot


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, **extra}}


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
View = Callable[..., HttpResponseBase]


def method_not_allowed(request: HttpRequest, allow: str) -> JsonResponse:
    return JsonResponse(
        error_body("method_not_allowed", f"{request.method} is not allowed here; this URL takes {allow}"),
        status=405,
        headers={"Allow": allow},
    )


def allow_methods(*methods: str) -> Callable[[View], View]:
    """A view that is no DRF view takes only `methods`; any other is a JSON 405 with Allow.

    The method is checked before CSRF: the view is exempt from CsrfViewMiddleware and, when
    it takes an unsafe method, CSRF-checked here after the method instead. A POST to a URL
    that never takes one was CSRF's HTML 403 for every client without a CSRF token (and
    logged as an attack), or Django's require_* answer: an empty text/html 405.

    OPTIONS is answered here, with Allow and no body, without running the view (a probe's
    checks, a stream): a 405 to OPTIONS whose Allow left OPTIONS out told a client nothing."""
    allow = ", ".join((*methods, "OPTIONS"))

    def decorate(view: View) -> View:
        checked = csrf_protect(view) if set(methods) - SAFE_METHODS else view

        @wraps(view)
        def only(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            if request.method == "OPTIONS":
                return HttpResponse(status=200, headers={"Allow": allow})
            if request.method not in methods:
                return method_not_allowed(request, allow)
            return checked(request, *args, **kwargs)

        return csrf_exempt(only)

    return decorate


def allow_methods_under(patterns: list[Any], *methods: str) -> list[Any]:
    """allow_methods on every view of URL patterns this project does not write (the admin's),
    changed in place and returned. The admin took any method as far as CSRF: PROPFIND or a
    made-up FOO was CSRF's HTML 403, logged as an attack, where every other edge answers a
    JSON 405 with Allow."""
    for entry in patterns:
        if isinstance(entry, URLResolver):
            allow_methods_under(entry.url_patterns, *methods)
        else:
            entry.callback = allow_methods(*methods)(entry.callback)
    return patterns


def unsafe_input_body(exc: json_safety.UnsafeInput) -> dict[str, Any]:
    """Hostile input (common.json_safety) in the one shape, naming where it is."""
    if isinstance(exc, json_safety.NotJson):
        return error_body("invalid_json", str(exc))
    return error_body("invalid_request", str(exc), fields={exc.where or "body": exc.problem})


def _first_message(detail: Any) -> str:
    if isinstance(detail, dict):
        field, value = next(iter(detail.items()))
        return f"{field}: {_first_message(value)}"
    if isinstance(detail, list) and detail:
        return _first_message(detail[0])
    return str(detail)


def _details(exc: Exception, reader: bool) -> dict[str, Any]:
    """What REST adds to a domain error's body beside the code and message. The task's
    snapshot only for a `reader` (access.may_read): a key without the read scope that acts
    (steers, cancels, answers) must not read the task through the act's refusal."""
    if isinstance(exc, VersionConflict):
        # The person's view is stale: here is the task as it is now (DESIGN §5). The version
        # alone to a caller that may not read: it is what acting again needs.
        snapshot = {"snapshot": task_snapshot(exc.task)} if reader else {}
        return {"currentVersion": exc.task.state_version, **snapshot}
    if isinstance(exc, AnswerConflict):
        # The answer that stands, so the client can tell "mine won" from "someone else's did".
        return {
            "key": exc.key,
            "answer": exc.answer,
            "answeredBy": exc.command.requested_by,
            "commandId": exc.command.command_id,
        }
    if isinstance(exc, CommandRefused) and exc.task is not None and reader:
        # As for a conflict: the task as it is now, so the caller sees why (finished, held).
        return {"snapshot": task_snapshot(exc.task)}
    return {}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, json_safety.UnsafeInput):  # from the body parser, or an action's last check
        return Response(unsafe_input_body(exc), status=status.HTTP_400_BAD_REQUEST)
    if (answer := errors.answer_for(exc)) is not None:
        who = getattr(context.get("request"), "auth", None)
        reader = isinstance(who, Principal) and access.may_read(who)
        body = error_body(answer.code, errors.message(exc), **_details(exc, reader))
        refused = Response(body, status=answer.http_status)
        if (step_up := scope_challenge(context.get("request"), who, exc)) is not None:
            refused["WWW-Authenticate"] = step_up  # a 403 that a token with more scope would lift
        return refused
    response = drf_handler(exc, context)
    if response is None:
        return None  # a real bug: let Django log it and answer 500
    if response.status_code == status.HTTP_401_UNAUTHORIZED or isinstance(exc, oauth.TokenForbidden):
        # Why it was refused (RFC 6750 §3), where DRF only has the view's fixed header.
        response["WWW-Authenticate"] = challenge(context["request"], exc)
    if isinstance(exc, exceptions.ValidationError):
        response.data = error_body("invalid_request", _first_message(exc.detail), fields=exc.detail)
    elif isinstance(exc, exceptions.NotFound) and exc.detail != exceptions.NotFound.default_detail:
        response.data = error_body("not_found", str(exc.detail))  # a view that names what it did not find
    elif isinstance(exc, Http404 | exceptions.NotFound):
        response.data = error_body("not_found", "no such task")
    else:
        code = getattr(exc, "default_code", "error")
        detail = getattr(exc, "detail", str(exc))
        response.data = error_body(str(code), _first_message(detail))
    return response


def json_400(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return JsonResponse(error_body("bad_request", str(exception or "bad request")), status=400)


def json_404(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return JsonResponse(error_body("not_found", f"no such resource: {request.path}"), status=404)


# A fault of the database (or another part: tasks_app.faults.infrastructure_fault, the one
# classification the engine retries on too) is not a bug, and over in seconds: down,
# restarting, unreachable, a session it ended, a statement it timed out or gave up on a lock
# or a deadlock. Every edge answers it "unavailable, retry", naming the cause: REST and the
# SSE view a 503 with Retry-After (here), /mcp -32003, an open stream its "unavailable" end.
RETRY_AFTER_SECONDS = 2


def unavailable(cause: str) -> JsonResponse:
    """The 503 of an infrastructure fault; `cause` from infrastructure_fault()."""
    return JsonResponse(
        error_body("unavailable", f"{cause}; retry shortly"),
        status=503,
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def json_500(request: HttpRequest) -> JsonResponse:
    # Django calls this inside its except block, for whatever a view or middleware raised.
    exc = sys.exc_info()[1]
    if exc is not None and (cause := infrastructure_fault(exc)) is not None:
        return unavailable(cause)
    if isinstance(exc, DjangoValidationError):
        # A model field refused a value from the request that the view passed on unchecked
        # (the admin's actions query with whatever ids were posted): the caller's mistake.
        return JsonResponse(error_body("invalid_request", "; ".join(exc.messages)), status=400)
    return JsonResponse(error_body("server_error", "internal error"), status=500)
