"""The dashboard in a real headless Chromium (Debian's, driven by Playwright) against a live
uvicorn and a real Celery worker: sign in, start a review, watch it live, pause, resume,
approve the publish step, see it complete; reject a publish; set the priority and re-aim a
running review; a stale version shows as a 409; a gap in seq makes the page re-read the
snapshot; an ended session leads to sign-in and back; another tenant's task stays
invisible. Every wait has a deadline; nothing sleeps."""

from __future__ import annotations

import os
import re
from pathlib import Path
from unittest import mock

import httpx
import pytest
from django.contrib.sessions.models import Session
from django.db import connections, transaction

from conftest import FAST_LEASES, Processes, free_port, make_persona
from runtime_site.blobstore import blob_store
from steering_app.actions import do_enqueue_command
from steering_app.models import SteeringCommand
from tasks_app import events
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents.document_review.corpus import generate_corpus
from tasks_app.models import Task
from tasks_app.selectors import task_snapshot
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db(transaction=True)

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
FAST = {**FAST_LEASES, "RUNTIME_SLICE_STEPS": "4"}
SECONDS = 1000  # Playwright timeouts are in milliseconds


@pytest.fixture
def browser(monkeypatch):
    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls are
    # still plain synchronous code, so Django's async-context guard does not apply here.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    from playwright.sync_api import expect, sync_playwright

    assert Path(CHROMIUM).exists(), "Debian's chromium is needed (bin/test installs it)"
    expect.set_options(timeout=30 * SECONDS)  # a shared 2-core CI box is slower than a laptop
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield browser
        browser.close()
        # Connections the test opened while Playwright's loop was current live in that
        # context: close them here, or the test database cannot be dropped afterwards.
        connections.close_all()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 1000})
    context.set_default_timeout(30 * SECONDS)
    page = context.new_page()
    yield page
    context.close()


def person(tenant: str, username: str, role: str):
    persona = make_persona(tenant, username, role)
    persona.user.set_password("pw")
    persona.user.save()
    return persona


def sign_in(page, base: str, username: str) -> None:
    from playwright.sync_api import expect

    page.goto(f"{base}/dashboard/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill("pw")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_test_id("who")).to_have_text(username)


def progress(page) -> int:
    return int(page.get_by_test_id("progress").text_content())


def wait_for_progress_above(page, value: int, timeout: float) -> int:
    page.wait_for_function(
        f"() => Number(document.querySelector('[data-testid=progress]').textContent) > {value}",
        timeout=timeout * SECONDS,
    )
    return progress(page)


def not_reloaded(page) -> bool:
    return page.evaluate("() => window.__sameDocument === true")


def mark_document(page) -> None:
    page.evaluate("() => { window.__sameDocument = true; }")


def test_a_person_runs_a_review_from_start_to_published_report(page, processes: Processes, tmp_path):
    from playwright.sync_api import expect

    april = person("acme", "april", "approver")  # may start, steer and approve
    generate_corpus(blob_store(), "corpora/dash", 160, 7, "2026-11-01")
    port = free_port()
    processes.web(port)
    processes.worker(**FAST)
    processes.beat(**FAST)
    base = f"http://127.0.0.1:{port}"

    sign_in(page, base, "april")
    page.get_by_role("link", name="Start a review").click()
    page.get_by_label("Corpus").fill("corpora/dash")
    page.get_by_label("Limit").fill("160")
    page.get_by_label("Batch size").fill("8")
    page.get_by_label("Pacing (ms per batch)").fill("700")
    page.get_by_label("Publish").check()
    page.get_by_test_id("start").click()
    page.wait_for_url(re.compile(r"/dashboard/tasks/[0-9a-f-]{36}/$"))
    task_id = page.url.rstrip("/").rsplit("/", 1)[1]
    task = Task.objects.get(id=task_id)
    assert task.created_by == f"user:{april.user.pk}" and task.agent == "document_review"

    # Live: the bar moves while the document stays the same (no reload).
    mark_document(page)
    expect(page.get_by_test_id("stream")).to_have_text("● live")
    first = wait_for_progress_above(page, 0, timeout=60)
    later = wait_for_progress_above(page, first, timeout=60)
    assert later > first and not_reloaded(page)
    expect(page.get_by_test_id("phase")).to_have_text("risk_classification")
    assert page.get_by_test_id("log").locator("li").count() > 0
    page.screenshot(
        path=str(Path(os.environ.get("DASHBOARD_SCREENSHOT", tmp_path / "dashboard-task.png"))), full_page=True
    )

    # Pause: accepted at once (pausing), lands at the worker's next safe point (paused).
    page.get_by_test_id("pause").click()
    expect(page.get_by_test_id("flash")).to_contain_text("pause accepted")
    mark_document(page)
    expect(page.get_by_test_id("status")).to_have_text("paused", timeout=30 * SECONDS)
    assert not_reloaded(page)
    assert Task.objects.get(id=task_id).status == "paused"
    paused_at = progress(page)
    expect(page.get_by_test_id("steering")).to_contain_text("pause")
    # Resume names the version it saw: wait for the panels carrying the paused version, or the
    # click races their reload and sends a stale expectedVersion (a 409, not a resume).
    paused_version = Task.objects.get(id=task_id).state_version
    expect(page.locator(".panels")).to_have_attribute("data-version", str(paused_version))

    page.get_by_test_id("resume").click()
    expect(page.get_by_test_id("flash")).to_contain_text("resume accepted")
    mark_document(page)
    # It carries on: the bar moves again (or, had the pause landed at the approval point, it asks).
    page.wait_for_function(
        f"() => Number(document.querySelector('[data-testid=progress]').textContent) > {paused_at}"
        " || document.querySelector('[data-testid=status]').textContent === 'input_required'",
        timeout=60 * SECONDS,
    )
    assert not_reloaded(page)

    # The publish step waits for an approver; the page offers the approval when it opens.
    expect(page.get_by_test_id("approve")).to_be_visible(timeout=120 * SECONDS)
    expect(page.get_by_test_id("status")).to_have_text("input_required")
    assert not_reloaded(page)
    assert page.get_by_test_id("checkpoints").locator("li").count() >= 1
    page.get_by_test_id("approve").click()
    expect(page.get_by_test_id("flash")).to_contain_text("approve sent")
    mark_document(page)
    expect(page.get_by_test_id("status")).to_have_text("completed", timeout=60 * SECONDS)
    expect(page.get_by_test_id("published")).to_contain_text("report.md")
    expect(page.get_by_test_id("progress")).to_have_text("100")
    assert not_reloaded(page)

    task.refresh_from_db()
    assert task.status == "completed" and task.result["published"]["ref"].endswith("report.md")
    assert task.result["documentsReviewed"] == 160


def test_a_stale_page_gets_a_409_with_the_current_state_and_tenants_stay_apart(page, browser, processes: Processes):
    from playwright.sync_api import expect

    alice = person("acme", "alice", "operator")
    person("globex", "mallory", "admin")
    port = free_port()
    processes.web(port)  # no worker: the task stays queued, and nothing but people change it
    base = f"http://127.0.0.1:{port}"
    task = new_task(alice)

    sign_in(page, base, "alice")
    # The list updates by itself: a task started elsewhere appears without a reload.
    page.goto(f"{base}/dashboard/")
    mark_document(page)
    expect(page.locator(f"tr[data-task='{task.id}']")).to_be_visible()
    later = new_task(alice)
    expect(page.locator(f"tr[data-task='{later.id}']")).to_be_visible(timeout=15 * SECONDS)
    assert not_reloaded(page)

    # A page whose live updates never arrived (blocked here) holds an old version ...
    page.route("**/runtime/tasks/*/events", lambda route: route.abort())
    page.goto(f"{base}/dashboard/tasks/{task.id}/")
    expect(page.get_by_test_id("version")).to_have_text(str(task.state_version))
    # ... while someone else changes the task through the API.
    changed = httpx.post(
        f"{base}/runtime/tasks/{task.id}/steering",
        headers={"Authorization": f"Bearer {alice.token}"},
        json={
            "commandId": "elsewhere",
            "type": "set_priority",
            "payload": {"priority": 2},
            "expectedVersion": task.state_version,
        },
        timeout=10,
    )
    assert changed.status_code == 202, changed.text
    page.get_by_test_id("pause").click()
    expect(page.get_by_test_id("conflict")).to_contain_text("Someone changed this task; here is its current state.")
    current = Task.objects.get(id=task.id)
    assert current.status == "queued"
    expect(page.get_by_test_id("version")).to_have_text(str(current.state_version))
    expect(page.get_by_test_id("priority")).to_have_text("2")
    # The 409 arrived by a redirect: the person is on the task page, and reloading it sends nothing.
    assert page.url == f"{base}/dashboard/tasks/{task.id}/"
    commands = SteeringCommand.objects.filter(task=task).count()
    page.reload()
    expect(page.get_by_test_id("version")).to_have_text(str(current.state_version))
    expect(page.get_by_test_id("conflict")).to_have_count(0)
    assert SteeringCommand.objects.filter(task=task).count() == commands
    # Looking at the current state, the person can try again, and now it lands.
    page.get_by_test_id("pause").click()
    expect(page.get_by_test_id("status")).to_have_text("paused")
    assert Task.objects.get(id=task.id).status == "paused"

    # Another tenant's admin sees none of it.
    other = browser.new_context()
    mallory_page = other.new_page()
    sign_in(mallory_page, base, "mallory")
    expect(mallory_page.locator("#task-list")).to_be_visible()
    assert str(task.id) not in mallory_page.content()
    mallory_page.goto(f"{base}/dashboard/tasks/{task.id}/")
    expect(mallory_page.get_by_test_id("not-found")).to_be_visible()
    events = mallory_page.request.get(f"{base}/runtime/tasks/{task.id}/events")
    assert events.status == 404
    other.close()


def review(persona, corpus: str, **input):
    task, _ = do_create_task(
        console(persona.tenant, f"user:{persona.user.pk}"),
        agent="document_review",
        goal="Find risky contracts",
        input={"corpus": corpus, **input},
    )
    return task


def test_an_approver_rejects_the_publish_from_the_page_and_nothing_is_published(page, processes: Processes):
    from playwright.sync_api import expect

    april = person("acme", "april", "approver")
    store = blob_store()
    generate_corpus(store, "corpora/dash-reject", 24, 5, "2026-11-01")
    port = free_port()
    processes.web(port)
    processes.worker(**FAST)
    base = f"http://127.0.0.1:{port}"
    task = review(april, "corpora/dash-reject", batchSize=8, publish=True)

    sign_in(page, base, "april")
    page.goto(f"{base}/dashboard/tasks/{task.id}/")
    expect(page.get_by_test_id("reject")).to_be_visible(timeout=60 * SECONDS)
    page.get_by_test_id("inputs").get_by_placeholder("reason (optional)").fill("not for the public")
    page.get_by_test_id("reject").click()
    expect(page.get_by_test_id("flash")).to_contain_text("reject sent")
    mark_document(page)
    # The rejection path: the run completes with its report written but not published.
    expect(page.get_by_test_id("status")).to_have_text("completed", timeout=60 * SECONDS)
    expect(page.get_by_test_id("not-published")).to_contain_text("Not published")
    expect(page.get_by_test_id("published")).to_have_count(0)
    expect(page.get_by_test_id("steering")).to_contain_text("not for the public")
    assert not_reloaded(page)
    task.refresh_from_db()
    assert "rejected" in task.result["published"] and not store.list(f"published/{task.id}")


def test_an_operator_sets_the_priority_and_re_aims_a_running_review_from_the_page(page, processes: Processes):
    from playwright.sync_api import expect

    otto = person("acme", "otto", "operator")
    generate_corpus(blob_store(), "corpora/dash-aim", 80, 9, "2026-11-01")
    port = free_port()
    processes.web(port)
    processes.worker(**FAST)
    base = f"http://127.0.0.1:{port}"
    # Slow enough batches that the worker holds the lease while the person steers.
    task = review(otto, "corpora/dash-aim", batchSize=4, pacingMs=500, publish=False)

    sign_in(page, base, "otto")
    page.goto(f"{base}/dashboard/tasks/{task.id}/")
    expect(page.get_by_test_id("status")).to_have_text("working", timeout=60 * SECONDS)

    # A priority change applies at once, even mid-step.
    page.get_by_test_id("priority-select").select_option("1")
    page.get_by_test_id("set-priority").click()
    expect(page.get_by_test_id("flash")).to_contain_text("set_priority accepted")
    expect(page.get_by_test_id("priority")).to_have_text("1")
    assert Task.objects.get(id=task.id).priority == 1

    # A new goal waits for the worker's next safe point; the page shows it land, live.
    page.get_by_test_id("goal").fill("Only contracts still in force")
    page.get_by_label("exclude expired").check()
    page.get_by_test_id("adjust-goal").click()
    expect(page.get_by_test_id("flash")).to_contain_text("adjust_goal accepted")
    mark_document(page)
    command = page.get_by_test_id("steering").locator("li", has_text="adjust_goal")
    expect(command.locator(".badge")).to_have_text("applied", timeout=60 * SECONDS)
    expect(page.get_by_test_id("goal-title")).to_have_text("Only contracts still in force")
    expect(page.get_by_test_id("checkpoints")).to_contain_text("plan v2", timeout=60 * SECONDS)
    assert not_reloaded(page)
    task.refresh_from_db()
    assert (task.goal, task.constraints.get("excludeExpired"), task.plan_version) == (
        "Only contracts still in force",
        True,
        2,
    )


def test_the_page_re_reads_the_snapshot_when_it_sees_a_gap_in_seq(page, processes: Processes):
    from playwright.sync_api import expect

    alice = person("acme", "alice", "operator")
    port = free_port()
    processes.web(port)  # no worker: only this test changes the task
    base = f"http://127.0.0.1:{port}"
    task = new_task(alice)
    snapshot_reads = []
    page.on("request", lambda r: snapshot_reads.append(r.url) if r.url.endswith("/snapshot") else None)

    def log_line(message: str) -> None:  # a log event, stored and published as a worker's is
        with transaction.atomic():
            events.emit(Task.objects.select_for_update().get(id=task.id), "log", {"step": 0, "message": message})

    sign_in(page, base, "alice")
    page.goto(f"{base}/dashboard/tasks/{task.id}/")
    expect(page.get_by_test_id("stream")).to_have_text("● live")
    mark_document(page)
    # A delivered event first: the stream is caught up and its live path works.
    log_line("before the gap")
    expect(page.get_by_test_id("log")).to_contain_text("before the gap")
    assert snapshot_reads == []

    # A change whose events never reach the page (stored, but the publish is lost, as
    # pub/sub may lose it) ...
    with mock.patch("tasks_app.streams.publish.publish"):
        do_enqueue_command(
            task.id,
            who=console(alice.tenant, "user:other"),
            command_id="unseen",
            type="set_priority",
            payload={"priority": 1},
            expected_version=task.state_version,
        )
        log_line("lost in the gap")
    # ... then one that does: its seq jumps, and the page re-reads the snapshot.
    log_line("after the gap")
    expect(page.get_by_test_id("log")).to_contain_text("after the gap")
    expect(page.get_by_test_id("priority")).to_have_text("1")
    # the log tail comes back whole and in order, the line only the lost events carried included
    expect(page.get_by_test_id("log").locator("li")).to_have_text(
        [re.compile("before the gap"), re.compile("lost in the gap"), re.compile("after the gap")]
    )
    truth = task_snapshot(Task.objects.get(id=task.id))
    expect(page.get_by_test_id("version")).to_have_text(str(truth["stateVersion"]))
    expect(page.get_by_test_id("status")).to_have_text(truth["runtimeStatus"])
    expect(page.get_by_test_id("priority")).to_have_text(str(truth["priority"]))
    expect(page.get_by_test_id("steering")).to_contain_text("set_priority")
    # The panels' forms now carry the current version.
    expect(page.locator("input[name=expected_version]").first).to_have_value(str(truth["stateVersion"]))
    assert len(snapshot_reads) == 1 and not_reloaded(page)


def test_a_late_snapshot_answer_never_paints_older_state_over_newer(page, processes: Processes):
    from playwright.sync_api import expect

    alice = person("acme", "alice", "operator")
    port = free_port()
    processes.web(port)  # no worker: only this test changes the task
    base = f"http://127.0.0.1:{port}"
    task = new_task(alice)
    held: dict = {}

    def hold_the_first(route) -> None:  # a busy server answering the first re-read last
        if held:
            route.continue_()
        else:
            held["route"] = route

    def set_priority(value: int) -> None:
        do_enqueue_command(
            task.id,
            who=console(alice.tenant, "user:other"),
            command_id=f"prio-{value}",
            type="set_priority",
            payload={"priority": value},
            expected_version=Task.objects.get(id=task.id).state_version,
        )

    sign_in(page, base, "alice")
    page.goto(f"{base}/dashboard/tasks/{task.id}/")
    expect(page.get_by_test_id("stream")).to_have_text("● live")
    page.route("**/snapshot", hold_the_first)
    with page.expect_request("**/snapshot"):
        set_priority(3)  # its steering.applied makes the page re-read the snapshot: held
    then = Task.objects.get(id=task.id)
    stale = {"seq": then.event_seq, **task_snapshot(then)}  # what the server would have answered then
    set_priority(1)  # the next re-read is answered at once
    expect(page.get_by_test_id("priority")).to_have_text("1")
    with page.expect_event("requestfinished", lambda r: r.url.endswith("/snapshot")):
        held["route"].fulfill(json=stale)  # priority 3, one seq older than what is on screen
    with transaction.atomic():  # an event after it, to know the page has moved on
        events.emit(Task.objects.select_for_update().get(id=task.id), "log", {"step": 0, "message": "later"})
    expect(page.get_by_test_id("log")).to_contain_text("later")
    truth = task_snapshot(Task.objects.get(id=task.id))
    assert page.get_by_test_id("priority").text_content() == "1" == str(truth["priority"])
    assert page.get_by_test_id("version").text_content() == str(truth["stateVersion"])


def test_panels_re_read_while_someone_types_keep_what_they_typed(page, processes: Processes):
    from playwright.sync_api import expect

    alice = person("acme", "alice", "operator")
    port = free_port()
    processes.web(port)  # no worker: the review stays queued; only this test and the person change it
    base = f"http://127.0.0.1:{port}"
    task = review(alice, "corpora/never-read")
    held: dict = {}

    def hold_the_first(route) -> None:  # a busy server: the panels come back while they type
        if held:
            route.continue_()
        else:
            held["route"] = route

    sign_in(page, base, "alice")
    page.goto(f"{base}/dashboard/tasks/{task.id}/")
    expect(page.get_by_test_id("stream")).to_have_text("● live")
    page.route("**/panels", hold_the_first)
    with page.expect_request("**/panels"):  # someone else's change makes the page re-read them
        do_enqueue_command(
            task.id,
            who=console(alice.tenant, "user:other"),
            command_id="elsewhere",
            type="set_priority",
            payload={"priority": 2},
            expected_version=task.state_version,
        )
    page.get_by_test_id("goal").fill("Only contracts still in force")
    page.get_by_label("exclude expired").check()
    page.get_by_test_id("goal-title").click()  # looks away: nobody is typing at this moment
    with page.expect_event("requestfinished", lambda r: r.url.endswith("/panels")):
        held["route"].continue_()
    expect(page.get_by_test_id("steering")).to_contain_text("set_priority")  # the panels are the new ones
    expect(page.get_by_test_id("goal")).to_have_value("Only contracts still in force")
    expect(page.get_by_label("exclude expired")).to_be_checked()
    page.get_by_test_id("adjust-goal").click()
    expect(page.get_by_test_id("flash")).to_contain_text("adjust_goal accepted")
    task.refresh_from_db()
    assert (task.goal, task.constraints.get("excludeExpired"), task.priority) == (
        "Only contracts still in force",
        True,
        2,
    )


def test_an_ended_session_sends_the_person_to_sign_in_and_back(page, processes: Processes):
    from playwright.sync_api import expect

    alice = person("acme", "alice", "operator")
    port = free_port()
    web = processes.web(port)
    base = f"http://127.0.0.1:{port}"
    task = new_task(alice)
    here = f"/dashboard/tasks/{task.id}/"

    sign_in(page, base, "alice")
    page.goto(base + here)
    expect(page.get_by_test_id("stream")).to_have_text("● live")
    # The session ends on the server while the page streams; then the stream drops (a restart).
    Session.objects.all().delete()
    Processes.kill(web)
    processes.web(port)
    # The reconnect is refused with a 401: the page goes to sign in, and comes back after.
    page.wait_for_url(f"{base}/dashboard/login/?next={here.replace('/', '%2F')}", timeout=30 * SECONDS)
    page.get_by_label("Username").fill("alice")
    page.get_by_label("Password").fill("pw")
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(base + here)
    expect(page.get_by_test_id("stream")).to_have_text("● live")

    # The task list polls; it does the same on its next poll.
    page.goto(f"{base}/dashboard/")
    expect(page.get_by_test_id("list-updated")).to_have_text("updated just now")
    # While polls fail, the list says how old it is; the next good poll makes it fresh again.
    page.route("**/dashboard/tasks.json", lambda route: route.abort())
    expect(page.get_by_test_id("list-updated")).to_have_text(re.compile(r"^updated \d+s ago$"))
    page.unroute("**/dashboard/tasks.json")
    expect(page.get_by_test_id("list-updated")).to_have_text("updated just now")
    Session.objects.all().delete()
    page.wait_for_url(f"{base}/dashboard/login/?next=%2Fdashboard%2F", timeout=15 * SECONDS)
