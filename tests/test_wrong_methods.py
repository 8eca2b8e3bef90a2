"""A method an edge does not take is a JSON 405 naming it, with Allow, on every URL that is
not a DRF view (those answer 405 through runtime_site/errors.py already): the event stream,
the probes, the schema, the dashboard, the redirects. It used to be CSRF's HTML 403 (logged
as an attack) for a client that sends no CSRF token, or an empty text/html 405.

Django's test client with CSRF checks on, as a client that is no browser sends: no token.
A form the dashboard takes still needs its token (CSRF is checked after the method)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task

# the SSE view closes its connection, which would end a test transaction
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def task(alice) -> Task:
    task, _ = do_create_task(console(alice.tenant, f"user:{alice.user.pk}"), agent="noop", input={"steps": 3})
    return task


def edges(task: Task) -> dict[str, str]:
    """path → the methods it takes (its Allow)."""
    page = f"/dashboard/tasks/{task.id}"
    return {
        f"/runtime/tasks/{task.id}/events": "GET, OPTIONS",
        "/healthz": "GET, HEAD, OPTIONS",
        "/readyz": "GET, HEAD, OPTIONS",
        "/metrics": "GET, HEAD, OPTIONS",
        "/runtime/schema": "GET, HEAD, OPTIONS",
        "/favicon.ico": "GET, HEAD, OPTIONS",
        "/": "GET, HEAD, OPTIONS",
        "/dashboard/": "GET, HEAD, OPTIONS",
        "/dashboard/tasks.json": "GET, HEAD, OPTIONS",
        "/dashboard/tasks/new": "GET, HEAD, POST, OPTIONS",
        f"{page}/": "GET, HEAD, OPTIONS",
        f"{page}/panels": "GET, HEAD, OPTIONS",
        f"{page}/snapshot": "GET, HEAD, OPTIONS",
        f"{page}/artifacts/report.md": "GET, HEAD, OPTIONS",
        f"{page}/steer": "POST, OPTIONS",
        f"{page}/inputs/q": "POST, OPTIONS",
        "/dashboard/login/": "GET, HEAD, POST, OPTIONS",
        "/dashboard/logout/": "POST, OPTIONS",
        "/.well-known/oauth-protected-resource": "GET, HEAD, OPTIONS",
        "/.well-known/oauth-protected-resource/mcp": "GET, HEAD, OPTIONS",
    }


def refused(response: Any, method: str, allow: str) -> None:
    assert response.status_code == 405, (method, response.status_code, response.content[:200])
    assert response["Allow"] == allow, (method, response["Allow"])
    assert response["Content-Type"] == "application/json", (method, response["Content-Type"])
    error = response.json()["error"]
    assert error["code"] == "method_not_allowed" and method in error["message"], error


@pytest.mark.parametrize("signed_in", [False, True], ids=["api-key", "session"])
def test_every_edge_that_is_not_drf_answers_a_method_it_does_not_take_with_a_json_405(alice, task, signed_in):
    strict = Client(enforce_csrf_checks=True, raise_request_exception=False)
    headers = {"HTTP_AUTHORIZATION": f"Bearer {alice.token}"}
    if signed_in:
        strict.force_login(alice.user)
        headers = {}
    for path, allow in edges(task).items():
        for method in ("POST", "PUT", "PATCH", "DELETE", "GET"):
            if method in allow:
                continue
            refused(strict.generic(method, path, **headers), method, allow)


def test_a_dashboard_form_still_needs_its_csrf_token(alice, task):
    """The method is checked first; a method the form takes is still CSRF-checked."""
    strict = Client(enforce_csrf_checks=True, raise_request_exception=False)
    strict.force_login(alice.user)
    before = task.state_version
    response = strict.post(f"/dashboard/tasks/{task.id}/steer", {"type": "pause", "expected_version": before})
    # dashboard.views.csrf_failure: back to the task page, nothing sent
    assert response.status_code == 303 and response["Location"] == f"/dashboard/tasks/{task.id}/", response
    assert Task.objects.get(id=task.id).state_version == before
    assert strict.post("/dashboard/tasks/new", {}).status_code == 303
    assert Task.objects.count() == 1


def test_every_edge_answers_options_with_its_allow_and_a_dashboard_page_answers_head(alice, task):
    """OPTIONS was a 405 whose Allow left OPTIONS out; HEAD on a dashboard page (a link
    checker, an uptime monitor) was a 405 although GET is served. Neither runs a probe's
    checks nor opens a stream."""
    strict = Client(enforce_csrf_checks=True, raise_request_exception=False)
    strict.force_login(alice.user)
    for path, allow in edges(task).items():
        response = strict.options(path)
        assert response.status_code == 200, (path, response.status_code, response.content[:200])
        assert response["Allow"] == allow, (path, response["Allow"])
    for path in ("/dashboard/", "/dashboard/tasks.json", "/dashboard/tasks/new", f"/dashboard/tasks/{task.id}/"):
        head, get = strict.head(path), strict.get(path)
        assert head.status_code == get.status_code == 200, (path, head.status_code, get.status_code)
        assert head["Content-Type"] == get["Content-Type"] and head.content == b"", path
    assert strict.head(f"/runtime/tasks/{task.id}/events").status_code == 405  # a stream has no head to send


@pytest.mark.parametrize("signed_in", [False, True], ids=["anonymous", "staff"])
def test_the_admin_answers_a_method_it_does_not_take_with_a_json_405(task, signed_in):
    """The admin is forms and pages: GET, HEAD and POST. Any other method (PROPFIND, a made-up
    FOO, PUT) was CSRF's HTML 403, logged as an attack, before the admin saw it."""
    from django.contrib.auth import get_user_model

    strict = Client(enforce_csrf_checks=True, raise_request_exception=False)
    if signed_in:
        strict.force_login(get_user_model().objects.create_superuser("root", "root@example.com", "pw"))
    allow = "GET, HEAD, POST, OPTIONS"
    for path in ("/admin/", "/admin/login/", "/admin/tasks_app/task/", f"/admin/tasks_app/task/{task.id}/change/"):
        for method in ("PROPFIND", "FOO", "PUT", "PATCH", "DELETE"):
            refused(strict.generic(method, path), method, allow)
        options = strict.options(path)
        assert options.status_code == 200 and options["Allow"] == allow, (path, options.status_code)
    assert strict.get("/admin/login/").status_code == (302 if signed_in else 200)  # a page, as before
