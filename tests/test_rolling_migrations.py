"""A rolling deploy (docs/operations.md) migrates first, then replaces the processes one by one:
meanwhile the previous release's web processes and workers write to the migrated schema. A
NOT NULL column they do not know must fill itself, with a default in the database (Django's
`default` is applied by the ORM only, and the migration drops it), or every insert of theirs
fails. tests/schema_without_db_defaults.txt lists the columns that were NOT NULL without a
database default before this check; any other such column fails it."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.db import connection

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
