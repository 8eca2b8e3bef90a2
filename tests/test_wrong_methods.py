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
        f"/runtime/tasks/{task.id}/events": "GET",
        "/healthz": "GET, HEAD",
        "/readyz": "GET, HEAD",
        "/metrics": "GET, HEAD",
        "/runtime/schema": "GET, HEAD, OPTIONS",
        "/favicon.ico": "GET, HEAD",
        "/": "GET, HEAD",
        "/dashboard/": "GET",
        "/dashboard/tasks.json": "GET",
        "/dashboard/tasks/new": "GET, POST",
        f"{page}/": "GET",
        f"{page}/panels": "GET",
        f"{page}/snapshot": "GET",
        f"{page}/artifacts/report.md": "GET",
        f"{page}/steer": "POST",
        f"{page}/inputs/q": "POST",
        "/dashboard/login/": "GET, POST",
        "/dashboard/logout/": "POST",
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
