"""The embedded profile's reads beside a writer. SQLite in WAL mode lets readers read while
one connection writes; the profile's transactions are IMMEDIATE (they take the write lock at
BEGIN), so a read that opens one to see one moment (selectors.one_snapshot: REST's task and
list, the dashboard's task views, the stream's snapshot) must not: it would queue behind
every worker's step for the write lock (up to the busy timeout, then "database is locked"),
and hold that lock itself, keeping every worker's write out while it renders."""

from __future__ import annotations

import sqlite3
import time

import httpx

from tests.test_embedded_profile import embedded_site  # noqa: F401 (the fixture)


def test_a_snapshot_read_does_not_wait_for_the_write_lock(embedded_site):  # noqa: F811
    client, _, data, _, _, _ = embedded_site
    task_id = client.post("/runtime/tasks", json={"agent": "noop", "input": {"steps": 3}}).json()["taskId"]
    assert client.get(f"/runtime/tasks/{task_id}").status_code == 200  # the key's last use written now, not below
    writer = sqlite3.connect(data / "runtime.sqlite3", isolation_level=None, timeout=0)
    try:
        writer.execute("BEGIN IMMEDIATE")  # a worker's step, mid-transaction: it holds the write lock
        started = time.monotonic()
        try:
            one = client.get(f"/runtime/tasks/{task_id}", timeout=8)
            listed = client.get("/runtime/tasks", timeout=8)
            with client.stream("GET", f"/runtime/tasks/{task_id}/events", timeout=8) as stream:
                assert stream.status_code == 200
                first = next(stream.iter_lines())  # the stream's snapshot, read in one_snapshot too
        except httpx.TimeoutException:
            raise AssertionError(f"a read waited {time.monotonic() - started:.1f} s for the write lock") from None
        assert one.status_code == 200, one.text
        assert listed.status_code == 200, listed.text
        assert [t["taskId"] for t in listed.json()["results"]] == [task_id]
        assert first == "event: task.snapshot", first
        assert time.monotonic() - started < 8
    finally:
        writer.execute("ROLLBACK")
        writer.close()
