"""The test runs' flush (tests/fixtures/management/commands/flush.py): what pytest-django
runs after each test that commits leaves every table empty, as Django's own flush does."""

from __future__ import annotations

import pytest
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command, get_commands
from django.db import connection

from tasks_app.tests.test_engine import new_task
from tests.fixtures.management.commands.flush import KEPT


@pytest.mark.django_db(transaction=True)
def test_the_flush_after_a_committing_test_empties_every_table_but_the_content_types(alice):
    assert get_commands()["flush"] == "tests.fixtures"
    new_task(alice)  # a tenant, a user, a key, a task, its audit record and event
    types = set(ContentType.objects.values_list("id", "app_label", "model"))
    # as django.test.TransactionTestCase._fixture_teardown calls it
    call_command("flush", verbosity=0, interactive=False, reset_sequences=False, allow_cascade=False)
    tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
    with connection.cursor() as cursor:
        left = set()
        for table in tables:
            cursor.execute(f"SELECT EXISTS (SELECT 1 FROM {connection.ops.quote_name(table)})")  # noqa: S608
            if cursor.fetchone()[0]:
                left.add(table)
    assert left == set(KEPT)
    assert set(ContentType.objects.values_list("id", "app_label", "model")) == types
