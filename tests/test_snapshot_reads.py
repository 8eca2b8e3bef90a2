"""A snapshot read on the full path (REST's task and list, the dashboard's snapshot) reads the
task's row, then its open questions if the row says it has any. Read apart, each query seeing
what was committed when it started, an answer committing between the two (the question
answered and the task working, in one transaction) showed the task input_required with no
question. Made to happen every time: right after the row's query, another session commits
the answer. Both reads now see one moment (selectors.one_snapshot)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.test import Client

from conftest import database_url
from steering_app.models import InputRequest
from tasks_app import engine
from tasks_app.models import Task

pytestmark = pytest.mark.django_db(transaction=True)  # the other session sees committed rows only


@pytest.fixture
def asking(alice) -> Task:
    from tasks_app.access import console
    from tasks_app.actions import do_create_task

    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 3, "askAt": 1})
    engine.run_slice(task.id, worker_id="w1")
    task.refresh_from_db()
    assert task.status == "input_required" and InputRequest.objects.filter(task=task, status="open").exists()
    return task


@contextmanager
def answered_after_the_row(task: Task) -> Iterator[list[str]]:
    """Right after the first query that reads the task's row, another session answers the question and sets the task working, as
    steering commits it for a task no worker holds."""
    seen: list[str] = []

    def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if not seen and f'FROM "{Task._meta.db_table}"' in sql:
            seen.append(sql)
            with psycopg.connect(database_url()) as other:
                other.execute(
                    f"UPDATE {InputRequest._meta.db_table} SET status = 'answered',"  # noqa: S608 (names from the models)
                    """ answer = '{"continue": true}', answered_by = 'user:other', answered_at = now()"""
                    " WHERE task_id = %s",
                    [task.id],
                )
                other.execute(
                    f"UPDATE {Task._meta.db_table} SET status = 'working', state_version = state_version + 1"  # noqa: S608
                    " WHERE id = %s",
                    [task.id],
                )
        return result

    with connection.execute_wrapper(wrapper):
        yield seen


def consistent(snapshot: dict[str, Any]) -> None:
    if snapshot["runtimeStatus"] == "input_required":
        assert snapshot.get("inputRequests"), f"input_required with no question: {snapshot}"
    else:
        assert snapshot["runtimeStatus"] == "working" and not snapshot.get("inputRequests"), snapshot


def test_the_rest_snapshot_reads_the_task_and_its_questions_at_one_moment(alice, asking):
    with answered_after_the_row(asking) as seen:
        answer = alice.client().get(f"/runtime/tasks/{asking.id}")
    assert answer.status_code == 200 and seen, answer.content
    consistent(answer.json())
    assert Task.objects.get(id=asking.id).status == "working"  # the answer did commit


def test_the_rest_list_reads_the_tasks_and_their_questions_at_one_moment(alice, asking):
    with answered_after_the_row(asking) as seen:
        answer = alice.client().get("/runtime/tasks")
    assert answer.status_code == 200 and seen, answer.content
    [row] = [t for t in answer.json()["results"] if t["taskId"] == str(asking.id)]
    consistent(row)


def test_the_dashboard_snapshot_reads_the_task_and_its_questions_at_one_moment(alice, asking):
    browser = Client()
    browser.force_login(alice.user)
    with answered_after_the_row(asking):
        answer = browser.get(f"/dashboard/tasks/{asking.id}/snapshot")
    assert answer.status_code == 200, answer.content
    consistent(answer.json())


@pytest.mark.parametrize("page", ["", "panels"])
def test_the_dashboard_task_page_reads_the_task_and_its_questions_at_one_moment(alice, asking, page):
    """The page renders after its view has returned, out of the snapshot (dashboard.views.TaskPage,
    so the blob store's listing runs outside it): what it shows of the task's rows must all
    have been read inside, none lazily as the template renders."""
    browser = Client()
    browser.force_login(alice.user)
    with answered_after_the_row(asking) as seen:
        answer = browser.get(f"/dashboard/tasks/{asking.id}/{page}")
    assert answer.status_code == 200 and seen, answer.content
    html = answer.content.decode()
    status = html.split('class="panels" data-version="', 1)[1].split('data-status="', 1)[1].split('"', 1)[0]
    questions = html.count('class="input-request"')
    assert (status, questions) in (("input_required", 1), ("working", 0)), (status, questions)
