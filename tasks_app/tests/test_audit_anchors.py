"""Audit anchors against real PostgreSQL: someone who can write the database rewrites, edits or
deletes the audit, and verify_audit tells, because the signed heads live outside it."""

from __future__ import annotations

import hashlib
import io
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from common.canonical import canonical_json
from runtime_site.blobstore import blob_store
from tasks_app import audit, engine
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Task
from tasks_app.tasks import anchor_audit

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def anchors_dir(settings, tmp_path: Path):
    """A blob store of this test's own, and a known key."""
    settings.RUNTIME_BLOB_DIR = tmp_path / "blobs"
    settings.RUNTIME_AUDIT_KEY = "key-one-" + "x" * 32
    settings.RUNTIME_AUDIT_RETIRED_KEYS = []
    blob_store.cache_clear()
    yield tmp_path / "blobs" / audit.ANCHOR_PREFIX
    blob_store.cache_clear()


def finished_task(persona, steps: int = 3) -> Task:
    task, _ = do_create_task(console(persona.tenant, "user:test"), agent="noop", input={"steps": steps})
    while engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE:
        pass
    return Task.objects.get(id=task.id)


def verify_audit_problems(*args: str) -> str:
    """verify_audit's complaints, one a line, or "" when everything verifies."""
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("verify_audit", *args, stdout=out, stderr=err)
    except CommandError as exc:
        return f"{err.getvalue()}{exc}"
    assert " 0 broken" in out.getvalue()
    return ""


def rewrite_chain_with_sql(task: Task) -> None:
    """What an attacker with database access does: change a record, then recompute every hash
    after it and the task's head, in plain SQL, so that the chain verifies again."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_app_auditrecord SET reason = 'nothing happened here' WHERE task_id = %s AND seq = 2",
            [task.id],
        )
        prev = audit.GENESIS
        for record in AuditRecord.objects.filter(task=task).order_by("seq"):
            record.prev_hash = prev
            fields = record.chained_fields()
            prev = hashlib.sha256(canonical_json(fields).encode()).hexdigest()
            cursor.execute(
                "UPDATE tasks_app_auditrecord SET prev_hash = %s, hash = %s WHERE id = %s",
                [record.prev_hash, prev, record.id],
            )
        cursor.execute("UPDATE tasks_app_task SET audit_head = %s WHERE id = %s", [prev, task.id])


def rechain_with_sql(task: Task, **changes: Any) -> None:
    """Set fields of every record of the task and recompute the chain and head, as someone who
    can write the database does (a chain no anchor holds verifies again afterwards)."""
    prev = audit.GENESIS
    with connection.cursor() as cursor:
        for record in AuditRecord.objects.filter(task=task).order_by("seq"):
            for name, change in changes.items():
                setattr(record, name, change(getattr(record, name)))
            record.prev_hash = prev
            prev = hashlib.sha256(canonical_json(record.chained_fields()).encode()).hexdigest()
            cursor.execute(
                "UPDATE tasks_app_auditrecord SET created_at = %s, reason = %s, prev_hash = %s, hash = %s WHERE id = %s",
                [record.created_at, record.reason, record.prev_hash, prev, record.id],
            )
        cursor.execute("UPDATE tasks_app_task SET audit_head = %s WHERE id = %s", [prev, task.id])


def set_task_column(task: Task, column: str, value: str) -> None:
    """An UPDATE of the task row in plain SQL (value: an SQL expression over the row)."""
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE tasks_app_task SET {column} = {value} WHERE id = %s", [task.id])  # noqa: S608


def test_a_rewrite_with_recomputed_hashes_is_caught_by_the_anchor(alice):
    task = finished_task(alice)
    assert audit.anchor_heads() is not None
    assert verify_audit_problems() == ""

    rewrite_chain_with_sql(task)

    assert verify_chain(Task.objects.get(id=task.id)) is None  # the chain alone is fooled
    problems = verify_audit_problems()
    assert f"task {task.id}: record {task.audit_seq}: differs from its anchor" in problems
    assert "chain rewritten" in problems


def test_an_edited_record_is_named_by_the_chain_and_by_the_anchor(alice):
    task = finished_task(alice)
    audit.anchor_heads()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_app_auditrecord SET data = '{\"approved\": true}' WHERE task_id = %s AND seq = 2", [task.id]
        )
    problems = verify_audit_problems()
    assert f"task {task.id}: record 2: content does not match its hash (edited)" in problems


def test_deleted_records_and_a_deleted_task_are_caught_by_the_anchor(alice):
    task, other = finished_task(alice), finished_task(alice)
    audit.anchor_heads()
    # The newest record goes, and the head is set back to the one before: the chain verifies.
    last = AuditRecord.objects.get(task=task, seq=task.audit_seq)
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM tasks_app_auditrecord WHERE id = %s", [last.id])
        cursor.execute(
            "UPDATE tasks_app_task SET audit_head = %s, audit_seq = audit_seq - 1 WHERE id = %s",
            [last.prev_hash, task.id],
        )
    assert verify_chain(Task.objects.get(id=task.id)) is None
    Task.objects.filter(id=other.id).delete()

    problems = verify_audit_problems()
    assert "3 audit problem(s)" not in problems  # exactly two
    assert "2 audit problem(s)" in problems
    assert f"task {task.id}: record {task.audit_seq}: deleted (anchored in" in problems
    assert f"task {other.id}: record {other.audit_seq}: task deleted (anchored in" in problems


def test_an_anchor_edited_in_the_blob_store_fails_its_signature(alice, anchors_dir):
    task = finished_task(alice)
    key = audit.anchor_heads()
    path = anchors_dir.parent / key
    anchor = json.loads(path.read_text())
    rewrite_chain_with_sql(task)
    anchor["heads"][0]["hash"] = Task.objects.get(id=task.id).audit_head  # without the key
    path.write_text(json.dumps(anchor))
    assert "signature does not verify (anchor edited)" in verify_audit_problems()


def test_a_rotated_key_still_verifies_the_old_anchors(alice, settings):
    first = finished_task(alice)
    audit.anchor_heads()
    old = settings.RUNTIME_AUDIT_KEY

    settings.RUNTIME_AUDIT_KEY, settings.RUNTIME_AUDIT_RETIRED_KEYS = "key-two-" + "y" * 32, [old]
    second = finished_task(alice)
    newer = json.loads(blob_store().get(audit.anchor_heads()))
    assert newer["kid"] == audit.key_id(settings.RUNTIME_AUDIT_KEY) != audit.key_id(old)
    assert [h["task"] for h in newer["heads"]] == [str(second.id)]  # only the chain that grew
    assert verify_audit_problems() == ""

    rewrite_chain_with_sql(first)  # old anchors keep their power after the rotation
    assert f"task {first.id}: record {first.audit_seq}: differs from its anchor" in verify_audit_problems()

    settings.RUNTIME_AUDIT_RETIRED_KEYS = []  # the retired key dropped too early
    assert f"signed with unknown key '{audit.key_id(old)}'" in verify_audit_problems()


def test_the_beat_job_anchors_only_what_grew(alice, anchors_dir, settings):
    assert "tasks.anchor_audit" in {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    finished_task(alice)
    anchor_audit()
    anchor_audit()  # nothing grew: no second object
    assert len(list(anchors_dir.rglob("*.json"))) == 1


def test_an_anchor_that_is_not_one_is_reported_and_every_other_still_checked(alice, anchors_dir):
    """Planting junk beside the anchors (or naming --since without a zone) made verify_audit
    die with a traceback before it named the rewrite the real anchor catches."""
    task = finished_task(alice)
    audit.anchor_heads()
    rewrite_chain_with_sql(task)
    junk = {"not-json": b"{not json", "a-list": b"[1, 2]", "no-time": json.dumps({"version": 1, "heads": []}).encode()}
    for name, body in junk.items():
        (anchors_dir / f"{name}.json").write_bytes(body)
    for since in ([], ["--since", "2020-01-01T00:00:00"], ["--since", "2020-01-01T00:00:00+02:00"]):
        out, err = io.StringIO(), io.StringIO()
        with pytest.raises(CommandError):
            call_command("verify_audit", *since, stdout=out, stderr=err)
        problems = err.getvalue()
        assert f"task {task.id}: record {task.audit_seq}: differs from its anchor" in problems, (since, problems)
        for name in junk:
            assert f"anchor {audit.ANCHOR_PREFIX}/{name}.json: not an anchor" in problems, (since, name, problems)


# --- Anchoring suppressed: what the anchor job reads is in the database too ---------------------


def test_a_chain_kept_from_its_anchor_by_moving_the_marker_is_a_gap(alice):
    """anchor_heads anchors the chains whose audit_seq is past audit_anchored_seq: a writer who
    moves the marker keeps a chain out of every anchor, free to be rewritten later."""
    task = finished_task(alice)
    set_task_column(task, "audit_anchored_seq", "audit_seq")
    assert audit.anchor_heads() is None  # the job is fooled: nothing seems to have grown

    problems = verify_audit_problems()
    assert f"task {task.id}: record {task.audit_seq}: marked anchored, but the anchors hold none of it" in problems
    assert "anchoring suppressed" in problems


def test_a_head_seq_set_back_is_named_by_the_chain(alice):
    """The other column the job reads: audit_seq set back hides a grown chain from it."""
    task = finished_task(alice)
    set_task_column(task, "audit_seq", "0")
    assert audit.anchor_heads() is None

    problems = verify_audit_problems()
    assert f"task {task.id}: head: task's audit seq 0 is not its last record's ({task.audit_seq})" in problems


def test_a_chain_left_out_of_a_later_anchor_is_a_gap_though_the_marker_was_moved_back(alice):
    """The marker moved for one anchor run and moved back: nothing in the database says so, but
    the chain's records were written before the newest anchor was taken and it holds none of
    them. The rewrite the gap made possible verifies as a chain."""
    hidden = finished_task(alice)
    rechain_with_sql(hidden, created_at=lambda at: at - timedelta(minutes=3))  # written a while ago
    set_task_column(hidden, "audit_anchored_seq", "audit_seq")
    other = finished_task(alice)
    anchor = json.loads(blob_store().get(audit.anchor_heads()))
    assert [h["task"] for h in anchor["heads"]] == [str(other.id)]
    set_task_column(hidden, "audit_anchored_seq", "0")  # the tracks covered
    rechain_with_sql(hidden, reason=lambda _: "nothing happened here")
    assert verify_chain(Task.objects.get(id=hidden.id)) is None

    problems = verify_audit_problems()
    assert f"task {hidden.id}: record 1: in no anchor (written " in problems, problems
    assert f"before the anchor of {anchor['taken_at']}" in problems
    assert f"task {other.id}" not in problems
    assert "1 audit problem(s)" in problems


def test_records_no_anchor_took_within_the_grace_are_a_gap(alice):
    """Anchoring stopped altogether (the beat job, its key, its queue): records wait past the
    grace. Within it they are not yet a problem; once anchored, never."""
    task = finished_task(alice)
    assert verify_audit_problems() == ""  # just written: within five anchor periods

    problems = verify_audit_problems("--anchor-grace", "0")
    assert f"task {task.id}: record 1: in no anchor (written " in problems
    assert "more than 0s ago): anchoring was stopped or suppressed" in problems

    audit.anchor_heads()
    assert verify_audit_problems("--anchor-grace", "0") == ""


def test_a_task_moved_to_another_tenant_with_its_audit_is_caught(alice, mallory):
    """The hash covers a record's task, not its tenant: moving a task and its records to
    another tenant leaves every chain intact. The anchor says whose the task was, and each
    record must be its task's tenant's."""
    task = finished_task(alice)
    audit.anchor_heads()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_app_auditrecord SET tenant_id = %s WHERE task_id = %s", [mallory.tenant.pk, task.id]
        )
    problems = verify_audit_problems()
    assert f"task {task.id}: record 1: tenant {mallory.tenant.pk} is not its task's ({alice.tenant.pk})" in problems

    set_task_column(task, "tenant_id", str(mallory.tenant.pk))
    problems = verify_audit_problems()
    assert verify_chain(Task.objects.get(id=task.id)) is None  # records and task agree again
    assert f"task {task.id}: record {task.audit_seq}: task now of tenant {mallory.tenant.pk}" in problems, problems


@pytest.mark.parametrize("grace", ["nan", "inf", "1e20", "-1", "soon"])
def test_an_anchor_grace_that_is_no_wait_is_refused_with_a_message(grace):
    # NaN, inf and 1e20 seconds used to end in a ValueError or OverflowError traceback from
    # timedelta; -1 counted every record as overdue.
    with pytest.raises(CommandError, match="anchor-grace"):
        call_command("verify_audit", "--anchor-grace", grace, stdout=io.StringIO(), stderr=io.StringIO())
