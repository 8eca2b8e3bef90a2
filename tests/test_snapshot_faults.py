import psycopg
import pytest
from django.db import connection
from django.test import Client

from conftest import database_url
from tasks_app.models import Task
from tests.test_snapshot_reads import asking  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


def killer(seen):
    def wrapper(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if not seen and f'FROM "{Task._meta.db_table}"' in sql:
            seen.append(sql)
            pid = connection.connection.info.backend_pid
            with psycopg.connect(database_url(), autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s)", [pid])
        return result

    return wrapper


@pytest.mark.parametrize(
    "path",
    [
        "/runtime/tasks/T",
        "/runtime/tasks",
        "/dashboard/tasks/T/",
        "/dashboard/tasks/T/snapshot",
        "/runtime/tasks/T/events",
    ],
)
def test_probe_fault(alice, asking, path):  # noqa: F811
    browser = Client(raise_request_exception=False)
    browser.force_login(alice.user)
    client = (
        browser
        if path.startswith("/dashboard")
        else Client(raise_request_exception=False, headers={"Authorization": f"Bearer {alice.token}"})
    )
    seen = []
    with connection.execute_wrapper(killer(seen)):
        r = client.get(path.replace("T", str(asking.id)))
    print(
        "PROBE",
        path,
        r.status_code,
        seen and "killed",
        r.content[:200] if not getattr(r, "streaming", False) else "stream",
    )
    assert seen
    assert r.status_code == 503, r.status_code
