"""The dashboard's artifact view reads the task (is it the person's?) and then the blob. Since
c9163b9 the whole view ran inside one_snapshot's transaction, so a blob that took longer to
read than the web's idle_in_transaction_session_timeout (RUNTIME_DB_IDLE_IN_TRANSACTION_SECONDS,
by default the lease) had its session ended by PostgreSQL under it: the artifact, read in
full, was answered 503 at the commit. The blob is slow for real here: a FIFO at its path,
written only after the limit."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.test import Client

from tasks_app import artifacts
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_artifact_slower_than_the_idle_in_transaction_limit_is_served(alice):
    task = new_task(alice)
    path = Path(settings.RUNTIME_BLOB_DIR) / artifacts.prefix(task) / "report.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    browser = Client(raise_request_exception=False)
    browser.force_login(alice.user)
    browser.get(f"/dashboard/tasks/{task.id}/")  # the session's first use, before the limit is set
    with connection.cursor() as cursor:  # the setting's shortest value, on the request's connection
        cursor.execute("SET idle_in_transaction_session_timeout = '1s'")

    def writer() -> None:
        time.sleep(2.5)  # the blob store's answer, after the limit (what is tested is this delay)
        with open(path, "wb") as fifo:
            fifo.write(b"# report\n")

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        answer = browser.get(f"/dashboard/tasks/{task.id}/artifacts/report.md")
    finally:
        thread.join()
    assert answer.status_code == 200, answer.content
    assert answer.content == b"# report\n"
