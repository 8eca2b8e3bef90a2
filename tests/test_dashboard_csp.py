"""Content-Security-Policy on the dashboard and the admin, and the TLS settings.

The browser test drives Debian's chromium (Playwright) against a live uvicorn: the pages
carry the policy, work under it (the task page streams, the progress bar is drawn, the
status filter submits itself) and the browser reports no CSP violation. The others check
the headers and the templates through the Django test client, and the TLS settings in a
process started with RUNTIME_TLS=true."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from conftest import ROOT, Processes, free_port
from tasks_app.tests.test_engine import new_task
from tests.test_dashboard import SECONDS, browser, page, person, sign_in  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db

# Every violation the page sees, from the first script on (an init script runs before the
# page's own and is not subject to its policy).
WATCH_VIOLATIONS = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__cspViolations.push(e.violatedDirective + " " + (e.blockedURI || "inline"));
});
"""


def test_the_dashboard_and_admin_work_under_the_policy_with_no_violation(page, processes: Processes):  # noqa: F811
    from playwright.sync_api import expect

    alice = person("acme", "alice", "operator")
    get_user_model().objects.filter(pk=alice.user.pk).update(is_staff=True, is_superuser=True)
    task = new_task(alice)
    port = free_port()
    processes.web(port)
    base = f"http://127.0.0.1:{port}"
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text))
    page.add_init_script(WATCH_VIOLATIONS)
    policies: list[str] = []
    page.on(
        "response",
        lambda r: (
            policies.append(r.headers.get("content-security-policy", ""))
            if r.request.resource_type == "document"
            else None
        ),
    )

    sign_in(page, base, "alice")
    # the list: its script starts itself (no inline call), polls, and the filter submits itself
    expect(page.get_by_test_id("list-updated")).to_have_text("updated just now")
    expect(page.locator(f'tr[data-task="{task.id}"]')).to_be_visible()
    page.locator("select[name=status]").select_option("queued")
    page.wait_for_url(re.compile(r"status=queued"))
    # the task page: the stream goes live and the bar gets its width from the script
    page.goto(f"{base}/dashboard/tasks/{task.id}/")
    expect(page.get_by_test_id("stream")).to_have_text("● live")
    width = page.evaluate("() => document.querySelector('[data-testid=progressbar] .fill').style.width")
    assert width == "0%"
    # the admin's pages, with its own scripts
    page.goto(f"{base}/admin/tasks_app/task/")
    expect(page.locator("#changelist")).to_be_visible()
    page.goto(f"{base}/admin/tasks_app/apikey/add/")
    expect(page.locator("#apikey_form")).to_be_visible()

    violations = page.evaluate("() => window.__cspViolations")
    assert violations == [], violations
    assert not [line for line in console if "Content Security Policy" in line], console
    assert policies and all("script-src 'self'" in p and "unsafe-inline" not in p for p in policies), policies


def test_dashboard_and_admin_pages_carry_the_policy_and_no_inline_script(alice):
    alice.user.set_password("pw")
    alice.user.is_staff = alice.user.is_superuser = True
    alice.user.save()
    task = new_task(alice)
    client = Client()
    assert client.login(username="alice", password="pw")
    for path in (
        "/dashboard/",
        f"/dashboard/tasks/{task.id}/",
        "/dashboard/tasks/new",
        "/admin/",
        "/admin/tasks_app/task/",
        "/dashboard/login/",
    ):
        response = client.get(path)
        assert response.status_code == 200, path
        policy = response["Content-Security-Policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe" not in policy
        if path.startswith("/dashboard/"):
            html = response.content.decode()
            assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), f"inline script in {path}"
            assert not re.search(r"\s(style|on[a-z]+)=", html), f"inline style or handler in {path}"


@pytest.mark.e2e  # a Python process of its own: TLS settings are read at start
def test_behind_tls_cookies_are_secure_and_hsts_is_sent():
    probe = (
        "import django, json; django.setup()\n"
        "from django.conf import settings; from django.test import Client\n"
        "r = Client().get('/dashboard/login/', headers={'X-Forwarded-Proto': 'https'})\n"
        "print(json.dumps({'hsts': r.headers.get('Strict-Transport-Security'),"
        " 'csrf_secure': bool(r.cookies['csrftoken']['secure']), 'session_secure': settings.SESSION_COOKIE_SECURE}))\n"
    )
    env = {"DJANGO_SETTINGS_MODULE": "runtime_site.settings", "RUNTIME_TLS": "true", "RUNTIME_TLS_PROXY_HEADER": "true"}
    import os

    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"hsts": "max-age=31536000", "csrf_secure": True, "session_secure": True}
