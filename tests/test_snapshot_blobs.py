"""The dashboard's artifact view reads the task (is it the person's?) and then the blob. Since
c9163b9 the whole view ran inside one_snapshot's transaction, so a blob that took longer to
read than the web's idle_in_transaction_session_timeout (RUNTIME_DB_IDLE_IN_TRANSACTION_SECONDS,
by default the lease) had its session ended by PostgreSQL under it: the artifact, read in
full, was answered 503 at the commit. The blob is slow for real here: a FIFO at its path,
written only after the limit.

The task page and its panels list a finished task's artifacts, a call to the blob store, and
did so inside the snapshot too: a slow listing was the same 503. The listing is slow for
real there: an S3 server (moto, over HTTP) behind a proxy that holds each request past the
limit."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.db import connection
from django.test import Client

from runtime_site.blobstore import S3BlobStore, blob_store
from tasks_app import artifacts
from tasks_app.tests.test_engine import new_task, run_to_end
from tests.test_blob_stores import s3  # noqa: F401 (the fixture)

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


@contextlib.contextmanager
def held_back(port: int, seconds: float) -> Iterator[int]:
    """A TCP proxy to 127.0.0.1:`port` that holds what each client sends `seconds` before
    passing it on (so every request is that late): a slow store on the wire. Yields its port."""
    server = socket.create_server(("127.0.0.1", 0))

    def pipe(source: socket.socket, sink: socket.socket, hold: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if hold:
                    time.sleep(seconds)  # the slow store (what is tested is this delay)
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def serve() -> None:
        with contextlib.suppress(OSError):  # the server closed: the test is over
            while True:
                client, _ = server.accept()
                upstream = socket.create_connection(("127.0.0.1", port))
                threading.Thread(target=pipe, args=(client, upstream, True), daemon=True).start()
                threading.Thread(target=pipe, args=(upstream, client, False), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@pytest.mark.parametrize("page", ["", "panels"])
def test_a_finished_tasks_page_with_an_artifact_listing_slower_than_the_limit_is_served(
    alice,
    s3: tuple[S3BlobStore, dict[str, str]],  # noqa: F811
    settings: Any,
    page: str,
):
    store, env = s3
    task = new_task(alice, steps=2)
    run_to_end(task)
    store.put(artifacts.prefix(task) + "report.md", b"# report\n")
    with held_back(urlsplit(env["RUNTIME_S3_ENDPOINT_URL"]).port or 80, seconds=2.5) as port:
        settings.RUNTIME_S3 = {
            "bucket": env["RUNTIME_S3_BUCKET"],
            "endpoint_url": f"http://127.0.0.1:{port}",
            "region_name": env["RUNTIME_S3_REGION"],
            "aws_access_key_id": env["RUNTIME_S3_ACCESS_KEY_ID"],
            "aws_secret_access_key": env["RUNTIME_S3_SECRET_ACCESS_KEY"],
        }
        blob_store.cache_clear()
        try:
            browser = Client(raise_request_exception=False)
            browser.force_login(alice.user)
            browser.get("/dashboard/")  # the session's first use, before the limit is set
            with connection.cursor() as cursor:  # the setting's shortest value, on the request's connection
                cursor.execute("SET idle_in_transaction_session_timeout = '1s'")
            answer = browser.get(f"/dashboard/tasks/{task.id}/{page}")
        finally:
            blob_store.cache_clear()
    assert answer.status_code == 200, answer.content[:2000]
    assert f'href="/dashboard/tasks/{task.id}/artifacts/report.md"'.encode() in answer.content
