"""A task's artifacts are served to people, not shown as file:// references: the REST route
(bearer key) and the dashboard route (session), each scoped to the caller's tenant."""

from __future__ import annotations

import copy

import pytest
from django.conf import settings
from django.test import override_settings
from rest_framework.test import APIClient

from runtime_site.blobstore import blob_store
from tasks_app.models import Task
from tasks_app.tests.test_engine import new_task
from tests.test_dashboard_views import signed_in

pytestmark = pytest.mark.django_db

REPORT = "# Risk report\n\n3 documents, 1 high risk.\n"


def finished_review(persona) -> Task:
    task = new_task(persona)
    ref = blob_store().put(f"tasks/{task.id}/artifacts/report.md", REPORT.encode(), "text/markdown")
    blob_store().put(f"tasks/{task.id}/artifacts/report.json", b'{"high": 1}', "application/json")
    Task.objects.filter(id=task.id).update(
        status="completed", result={"documentsReviewed": 3, "report": {"markdown": ref}}
    )
    return Task.objects.get(id=task.id)


def test_the_api_lists_and_serves_a_tasks_artifacts_to_its_tenant_only(alice, mallory):
    task = finished_review(alice)
    api = alice.client()
    listed = api.get(f"/runtime/tasks/{task.id}/artifacts").json()["results"]
    assert [(a["name"], a["url"]) for a in listed] == [
        ("report.json", f"/runtime/tasks/{task.id}/artifacts/report.json"),
        ("report.md", f"/runtime/tasks/{task.id}/artifacts/report.md"),
    ]
    served = api.get(f"/runtime/tasks/{task.id}/artifacts/report.md")
    assert served.status_code == 200 and served.content.decode() == REPORT
    assert served["Content-Type"].startswith("text/markdown") and served["X-Content-Type-Options"] == "nosniff"
    assert "sandbox" in served["Content-Security-Policy"] and served["Content-Disposition"].startswith("inline")
    download = api.get(f"/runtime/tasks/{task.id}/artifacts/report.md?download=1")
    assert download["Content-Disposition"] == 'attachment; filename="report.md"'
    assert api.get(f"/runtime/tasks/{task.id}").json()["artifactsUrl"] == f"/runtime/tasks/{task.id}/artifacts"

    other = mallory.client()
    assert other.get(f"/runtime/tasks/{task.id}/artifacts").status_code == 404
    assert other.get(f"/runtime/tasks/{task.id}/artifacts/report.md").status_code == 404
    assert api.get(f"/runtime/tasks/{task.id}/artifacts/nothing.md").json()["error"]["code"] == "not_found"
    assert api.get(f"/runtime/tasks/{task.id}/artifacts/..%2Fsecret").status_code == 404
    assert APIClient().get(f"/runtime/tasks/{task.id}/artifacts/report.md").status_code in (401, 403)


def test_an_artifact_over_the_size_limit_is_a_413_naming_the_limit(alice):
    task = finished_review(alice)
    runtime = copy.deepcopy(settings.RUNTIME)
    runtime["api"]["max_artifact_bytes"] = 10
    with override_settings(RUNTIME=runtime):
        response = alice.client().get(f"/runtime/tasks/{task.id}/artifacts/report.md")
    assert response.status_code == 413 and "max_artifact_bytes" in response.json()["error"]["message"]


def test_the_dashboard_links_the_report_to_a_route_that_serves_it(alice, mallory, client):
    task = finished_review(alice)
    signed_in(client, alice)
    page = client.get(f"/dashboard/tasks/{task.id}/").content.decode()
    url = f"/dashboard/tasks/{task.id}/artifacts/report.md"
    assert f'<a data-testid="report" href="{url}">report.md</a>' in page and "file://" not in page
    assert client.get(url).content.decode() == REPORT
    client.logout()
    signed_in(client, mallory)
    assert client.get(url).status_code == 404


def test_rt_lists_and_fetches_an_artifact(alice, mallory, processes, tmp_path):
    from conftest import free_port
    from tests.test_cli import Rt

    task = finished_review(alice)
    port = free_port()
    processes.web(port)
    rt = Rt(f"http://127.0.0.1:{port}", alice.token)
    listed = rt.run("artifact", str(task.id))
    assert listed.returncode == 0 and listed.stdout.splitlines() == [
        "report.json\tapplication/json",
        "report.md\ttext/markdown; charset=utf-8",
    ]
    fetched = rt.run("artifact", str(task.id), "report.md")
    assert fetched.returncode == 0 and fetched.stdout == REPORT
    assert rt.run("artifact", str(task.id), "report.md", "-o", str(tmp_path / "r.md")).returncode == 0
    assert (tmp_path / "r.md").read_text() == REPORT
    theirs = Rt(f"http://127.0.0.1:{port}", mallory.token).run("artifact", str(task.id), "report.md")
    assert theirs.returncode == 2 and "404" in theirs.stderr


def test_the_dashboard_shows_a_planners_answer_plan_and_token_usage(alice, client):
    task = new_task(alice)
    Task.objects.filter(id=task.id).update(
        agent="planner",
        status="completed",
        result={
            "answer": "recorded blue",
            "planVersion": 2,
            "model": "second",
            "plan": [{"id": "s1", "title": "record the first thing", "status": "done"}],
            "usage": {"modelCalls": 5, "inputTokens": 600, "outputTokens": 110, "cost": 0.0, "perStep": []},
        },
    )
    signed_in(client, alice)
    page = client.get(f"/dashboard/tasks/{task.id}/").content.decode()
    assert "recorded blue" in page and "[done] record the first thing" in page
    assert "5 model calls; 600 input and 110 output tokens." in page
