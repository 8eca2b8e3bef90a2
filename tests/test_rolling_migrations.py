"""A rolling deploy (docs/operations.md) migrates first, then replaces the processes one by one:
meanwhile the previous release's web processes and workers write to the migrated schema. A
NOT NULL column they do not know must fill itself, with a default in the database (Django's
`default` is applied by the ORM only, and the migration drops it), or every insert of theirs
fails. tests/schema_without_db_defaults.txt lists the columns that were NOT NULL without a
database default before this check; any other such column fails it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from django.db import connection

from conftest import Processes, free_port
from tasks_app.models import Task

pytestmark = pytest.mark.django_db

KNOWN = Path(__file__).with_name("schema_without_db_defaults.txt")


def test_a_column_added_since_the_last_release_fills_itself_for_the_previous_releases_inserts():
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT table_name || '.' || column_name FROM information_schema.columns
                WHERE table_schema = current_schema() AND is_nullable = 'NO' AND column_default IS NULL
                  AND is_identity = 'NO' AND table_name ~ '^(tasks_app|steering_app|checkpoints_app|ledger_app)_'"""
        )
        columns = {name for (name,) in cursor.fetchall()}
    known = {line for line in KNOWN.read_text().splitlines() if line and not line.startswith("#")}
    assert not columns - known, (
        f"NOT NULL without a database default: {sorted(columns - known)}; the previous release's inserts "
        "would fail during a rolling deploy: declare db_default (or null=True)"
    )


@pytest.mark.django_db(transaction=True)  # the web process must see the rows; the migration runs beside it
def test_a_web_process_whose_prepared_write_a_migration_outdated_answers_503_then_normally(alice, processes: Processes):
    """A creation's event is a held write (tasks_app.leases.held_write), prepared on the
    connection once it has run a few times. A migration that changes the type of a column it
    reads back makes PostgreSQL refuse the prepared statement ("cached plan must not change
    result type"): a fault of the moment, answered as one (503, retry), never a 500."""
    port = free_port()
    # One connection, on which every creation writes: prepared from its sixth.
    processes.web(port, RUNTIME_DB_POOL_MAX="1", RUNTIME_DB_PREPARE_THRESHOLD="5")
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {alice.token}"}, timeout=30
    )

    def create() -> httpx.Response:
        return client.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 1}})

    for _ in range(8):
        assert create().status_code == 201
    table = Task._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE {table} ALTER COLUMN event_seq TYPE integer")
    try:
        answers = [create() for _ in range(3)]
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} ALTER COLUMN event_seq TYPE bigint")
    for answer in answers:
        assert answer.status_code in (201, 503), (answer.status_code, answer.text[:300])
        if answer.status_code == 503:
            assert int(answer.headers["Retry-After"]) > 0 and answer.json()["error"]["code"] == "unavailable"
    assert answers[-1].status_code == 201
