"""A person opens a finished review in a real browser: the report is a link the dashboard
serves (no file:// string) and the risk distribution is drawn as a chart."""

from __future__ import annotations

import pytest

from conftest import Processes, free_port
from tasks_app.models import Task
from tests.test_dashboard import browser, page, person, sign_in  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_person_opens_the_reviews_report_and_sees_its_risk_chart(page, processes: Processes):  # noqa: F811
    from playwright.sync_api import expect

    from runtime_site.blobstore import blob_store
    from tasks_app.access import console
    from tasks_app.actions import do_create_task

    alice = person("acme", "alice", "admin")
    task = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 1})[0]
    ref = blob_store().put(
        f"tasks/{task.id}/artifacts/report.md", b"# Risk report\n\n2 high-risk contracts.\n", "text/markdown"
    )
    Task.objects.filter(id=task.id).update(
        status="completed",
        result={"documentsReviewed": 10, "byLevel": {"low": 6, "medium": 2, "high": 2}, "report": {"markdown": ref}},
    )
    port = free_port()
    processes.web(port)
    base = f"http://127.0.0.1:{port}"
    sign_in(page, base, "alice")
    page.goto(f"{base}/dashboard/tasks/{task.id}/")

    chart = page.get_by_test_id("risk-chart")
    expect(chart).to_be_visible()
    widths = {
        level: float(page.get_by_test_id(f"risk-bar-{level}").get_attribute("width"))
        for level in ("low", "medium", "high")
    }
    assert widths["low"] == 220 and widths["medium"] == widths["high"] == round(220 * 2 / 6)
    assert page.get_by_test_id("risk-bar-high").bounding_box()["width"] > 0  # drawn, not just in the markup

    report = page.get_by_test_id("report")
    expect(report).to_have_text("report.md")
    assert "file://" not in page.content()
    with page.expect_response(lambda r: "/artifacts/report.md" in r.url) as served:
        report.click()
    assert served.value.status == 200
    expect(page.locator("body")).to_contain_text("2 high-risk contracts.")
