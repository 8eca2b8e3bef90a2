"""The web process serves the admin's and the dashboard's stylesheets and scripts itself
(whitenoise, after collectstatic as bin/run and the image run it), with DEBUG off as in
every deployed profile: a real Chromium loads the pages and no request fails."""

from __future__ import annotations

import os

import pytest

from conftest import Processes, free_port, make_persona
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tests.test_dashboard import browser, page  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


class Requests:
    """Every stylesheet and script the page asked for, and every request or console line that failed."""

    def __init__(self, page) -> None:  # noqa: F811
        self.assets: dict[str, int] = {}
        self.failed: list[str] = []
        page.on("requestfailed", lambda request: self.failed.append(f"{request.url}: {request.failure}"))
        page.on("response", self._response)
        page.on("console", lambda message: message.type == "error" and self.failed.append(f"console: {message.text}"))

    def _response(self, response) -> None:
        if response.status >= 400:
            self.failed.append(f"{response.url}: HTTP {response.status}")
        if response.request.resource_type in ("stylesheet", "script"):
            self.assets[response.url.split("?")[0].rsplit("/static/", 1)[-1]] = response.status


def test_admin_and_dashboard_load_their_stylesheets_and_scripts(page, processes: Processes, tmp_path):  # noqa: F811
    assert os.environ.get("DJANGO_DEBUG", "false") == "false"  # uvicorn runs as deployed
    oscar = make_persona("acme", "oscar", "admin")
    oscar.user.is_staff = oscar.user.is_superuser = True
    oscar.user.set_password("pw")
    oscar.user.save()
    task, _ = do_create_task(console(oscar.tenant, "user:oscar"), agent="noop", input={"steps": 1})
    port = free_port()
    processes.web(port)
    base = f"http://127.0.0.1:{port}"
    seen = Requests(page)

    page.goto(f"{base}/admin/login/")
    page.get_by_label("Username").fill("oscar")
    page.get_by_label("Password").fill("pw")
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"{base}/admin/")
    # Styled: the admin's header takes its colour from base.css.
    header = page.evaluate("() => getComputedStyle(document.querySelector('#header')).backgroundColor")
    assert header not in ("", "rgba(0, 0, 0, 0)"), header
    page.goto(f"{base}/admin/tasks_app/task/")  # the change list also loads jQuery and the actions script
    page.locator("#result_list").wait_for()
    page.screenshot(path=str(tmp_path / "admin-tasks.png"))  # for people: what an operator sees
    page.goto(f"{base}/dashboard/tasks/{task.id}/")
    page.get_by_test_id("progress").wait_for()
    page.wait_for_load_state("networkidle")
    # dashboard.css makes the brand bold; without it the page has the browser's defaults.
    brand = page.evaluate("() => getComputedStyle(document.querySelector('header .brand')).fontWeight")
    assert brand == "700", brand

    assert seen.failed == []
    for asset in (
        "admin/css/base.css",
        "admin/js/theme.js",
        "admin/js/vendor/jquery/jquery.min.js",
        "admin/js/actions.js",
        "dashboard/dashboard.css",
        "dashboard/dashboard.js",
    ):
        assert seen.assets.get(asset) == 200, (asset, seen.assets)
