"""A steering accept whose connection the database ends after any one of its statements
(pg_terminate_backend: a failover, an operator): the caller gets a 503, and nothing of the
command is left: no command row, no record, no event, the task's row as it was, its chain
whole. Then the same command again is accepted as new (a3f849a wrote the accepted record
last, with the row, and inserted a command settled)."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection
from django.test import Client

from conftest import database_url
from steering_app.models import SteeringCommand
from steering_app.tests.test_accept_matrix import PAYLOADS, check, setup
from tasks_app.models import AuditRecord, Task, TaskEvent

pytestmark = pytest.mark.django_db(transaction=True)


def ended_after(statement: int, seen: list[str]):
    def wrapper(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        seen.append(sql)
        if len(seen) == statement:
            pid = connection.connection.info.backend_pid
            with psycopg.connect(database_url(), autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s)", [pid])
        return result

    return wrapper


@pytest.mark.parametrize("statement", range(1, 12))
@pytest.mark.parametrize(("state", "type"), [("paused", "resume"), ("working", "set_priority"), ("queued", "cancel")])
def test_a_fault_after_any_statement_of_an_accept_leaves_nothing_of_it(alice, state, type, statement):
    task = setup(alice, state, "none")
    was = Task.objects.get(id=task.id)
    client = Client(raise_request_exception=False, headers={"Authorization": f"Bearer {alice.token}"})
    client.get(f"/runtime/tasks/{task.id}")  # the key's last use written now, not in the count below
    body = {"commandId": "c1", "type": type, "payload": PAYLOADS[type], "expectedVersion": was.state_version}
    seen: list[str] = []
    with connection.execute_wrapper(ended_after(statement, seen)):
        answer = client.post(f"/runtime/tasks/{task.id}/steering", body, content_type="application/json")
    if len(seen) < statement:
        assert answer.status_code == 202, answer.content  # fewer statements than that: nothing ended
        check(task)
        return
    assert answer.status_code in (503, 202), answer.content
    if answer.status_code == 503:
        after = Task.objects.get(id=task.id)
        fields = ("state_version", "status", "audit_seq", "audit_head", "event_seq", "priority", "updated_at")
        assert [getattr(after, f) for f in fields] == [getattr(was, f) for f in fields]
        assert not SteeringCommand.objects.filter(task=task).exists()
        assert AuditRecord.objects.filter(task=task).count() == was.audit_seq
        assert TaskEvent.objects.filter(task=task).count() == was.event_seq
    check(task)
    again = client.post(f"/runtime/tasks/{task.id}/steering", body, content_type="application/json")
    assert again.status_code == 202, again.content
    check(task)
