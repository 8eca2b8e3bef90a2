"""Hash-chained audit records, one chain per task (DESIGN §3), anchored outside the database.

Each record's hash covers its fields and the previous record's hash; the task row holds
the head. Rewriting, deleting or reordering any record breaks the chain at that point.

The chain alone cannot catch someone who can write the database: they can rewrite every
record and recompute every hash and the head. So a beat job (anchor_heads) signs the heads
of the chains that grew with a secret that is not in the database (RUNTIME_AUDIT_KEY,
HMAC-SHA256) and writes them as one blob-store object per run. verify_anchors holds the
records against every anchor: an anchored record that is gone or hashes differently was
deleted or rewritten after it was anchored. Only records newer than the last anchor
(`audit.anchor_seconds`) rely on the chain alone.

Anchoring itself reads the database (which chains grew: Task.audit_seq against
Task.audit_anchored_seq), so a database writer could keep a chain from ever being anchored
and then rewrite it at leisure. verify_anchors also holds the anchors against that
(_check_coverage, docs/operations.md#audit-anchors): a task marked anchored beyond what any
anchor holds, and a record that should have been anchored by now (written before the newest
complete anchor was taken, or longer ago than the grace) but is in no anchor, are gaps;
verify_chain checks that the task's audit_seq is its chain's last record.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Case, Exists, F, IntegerField, Max, OuterRef, Value, When
from django.db.models.functions import Greatest
from django.utils import timezone

from common.canonical import canonical_json, sha256_hex
from runtime_site.blobstore import BlobStore, blob_store
from tasks_app import leases
from tasks_app.models import AuditRecord, Task
from tasks_app.redaction import redact

GENESIS = "0" * 64


def _hash(record: AuditRecord) -> str:
    return sha256_hex(canonical_json(record.chained_fields()))


def record_audit(
    task: Task,
    *,
    actor: str,
    action: str,
    before_version: int,
    from_status: str = "",
    to_status: str = "",
    reason: str = "",
    data: dict[str, Any] | None = None,
) -> AuditRecord:
    """In-transaction helper. The caller holds the task row (lock or fence) and saves nothing
    of the chain itself: this updates task.audit_seq/audit_head in the same transaction."""
    assert transaction.get_connection().in_atomic_block, "audit inside the change's transaction"
    record = next_record(
        task,
        actor=actor,
        action=action,
        before_version=before_version,
        from_status=from_status,
        to_status=to_status,
        reason=reason,
        data=data,
    )
    # The record and the chain's new head on the task row, in one statement where it can be.
    leases.held_write(task, {"audit_seq": record.seq, "audit_head": record.hash}, rows=[leases.Row(record)])
    return record


def next_record(
    task: Task,
    *,
    actor: str,
    action: str,
    before_version: int,
    from_status: str = "",
    to_status: str = "",
    reason: str = "",
    data: dict[str, Any] | None = None,
) -> AuditRecord:
    """The record record_audit writes, chained to the head `task` holds and not saved; the
    head moves on `task` (not in the database). A write of its own must then save it and
    the new head together, and only if the chain's head is still the one used here (the
    engine's one-statement step commit: tasks_app.leases.fenced_write's expect)."""
    record = AuditRecord(
        tenant_id=task.tenant_id,
        task=task,
        seq=task.audit_seq + 1,
        actor=actor,
        action=action,
        from_status=from_status,
        to_status=to_status,
        before_version=before_version,
        after_version=task.state_version,
        reason=redact(reason)[:1000],
        data=redact(data or {}),
        created_at=timezone.now(),
        prev_hash=task.audit_head or GENESIS,
    )
    record.hash = _hash(record)
    task.audit_seq, task.audit_head = record.seq, record.hash
    return record


@dataclass(frozen=True)
class BrokenLink:
    task_id: str  # "" for an anchor that is itself bad
    seq: int | None
    problem: str

    def __str__(self) -> str:
        if not self.task_id:
            return self.problem
        where = f"record {self.seq}" if self.seq is not None else "head"
        return f"task {self.task_id}: {where}: {self.problem}"


def verify_chain(task: Task) -> BrokenLink | None:
    """The first broken link of one task's chain, or None when it verifies."""
    prev, expected_seq = GENESIS, 1
    for record in AuditRecord.objects.filter(task=task).order_by("seq").iterator():
        if record.seq != expected_seq:
            return BrokenLink(str(task.id), expected_seq, f"missing (found {record.seq} next)")
        if record.prev_hash != prev:
            return BrokenLink(str(task.id), record.seq, "prev_hash does not match the previous record")
        if _hash(record) != record.hash:
            return BrokenLink(str(task.id), record.seq, "content does not match its hash (edited)")
        if record.tenant_id != task.tenant_id:
            # The hash covers the record's task, not its tenant: a record moved to another
            # tenant (out of its auditors' sight) is caught here, a moved task by its anchor.
            return BrokenLink(
                str(task.id), record.seq, f"tenant {record.tenant_id} is not its task's ({task.tenant_id})"
            )
        prev, expected_seq = record.hash, expected_seq + 1
    if task.audit_head != (prev if prev != GENESIS else ""):
        return BrokenLink(str(task.id), None, "task's audit head does not match the last record")
    if task.audit_seq != expected_seq - 1:
        # What anchor_heads reads to find the chains that grew: set back, it hides them.
        return BrokenLink(
            str(task.id), None, f"task's audit seq {task.audit_seq} is not its last record's ({expected_seq - 1})"
        )
    return None


# --- Anchors ---------------------------------------------------------------------------------

ANCHOR_PREFIX = "audit-anchors"
ANCHOR_BATCH = 5000  # heads per object; a backlog (first run, long outage) takes several runs
# A record is stamped (created_at) before its transaction commits: one stamped this long
# before an anchor was taken had committed by then, and that anchor had to take its chain.
COMMIT_SLACK = timedelta(seconds=60)


def anchor_grace() -> timedelta:
    """How long a record may wait for its first anchor before verify_audit calls it a gap:
    five runs of the beat job (a backlog of more than ANCHOR_BATCH chains takes several),
    and never less than five minutes."""
    return max(timedelta(seconds=5 * float(settings.RUNTIME["audit"]["anchor_seconds"])), timedelta(minutes=5))


@dataclass
class Coverage:
    """What the verified anchors hold: each task's newest anchored seq, and when the newest
    anchor that took every grown chain of its run (fewer than ANCHOR_BATCH heads) was taken."""

    anchored: dict[str, int] = field(default_factory=dict)
    newest_complete: datetime | None = None

    def add(self, taken_at: datetime, heads: list[dict[str, Any]]) -> None:
        for head in heads:
            self.anchored[head["task"]] = max(self.anchored.get(head["task"], 0), int(head["seq"]))
        if len(heads) < ANCHOR_BATCH and (self.newest_complete is None or taken_at > self.newest_complete):
            self.newest_complete = taken_at


def key_id(secret: str) -> str:
    """Names a key in its anchors without revealing anything about it."""
    return hmac.new(secret.encode(), b"runtime audit key id", hashlib.sha256).hexdigest()[:16]


def _signature(body: dict[str, Any], secret: str) -> str:
    return hmac.new(secret.encode(), canonical_json(body).encode(), hashlib.sha256).hexdigest()


def _verification_keys() -> dict[str, str]:
    keys = [*settings.RUNTIME_AUDIT_RETIRED_KEYS, settings.RUNTIME_AUDIT_KEY]
    return {key_id(k): k for k in keys if k}


def anchor_heads(*, store: BlobStore | None = None) -> str | None:
    """Beat job (tasks.anchor_audit): sign the heads of the chains that grew since their last
    anchor and write them as one object; returns its key, or None when nothing grew (or no key)."""
    secret = settings.RUNTIME_AUDIT_KEY
    if not secret:
        return None
    heads = list(
        Task.objects.filter(audit_seq__gt=F("audit_anchored_seq"))
        .order_by("id")
        .values_list("id", "tenant_id", "audit_seq", "audit_head")[:ANCHOR_BATCH]
    )
    if not heads:
        return None
    now = timezone.now()
    body = {
        "version": 1,
        "deployment": settings.RUNTIME_DEPLOYMENT,
        "taken_at": now.isoformat(),
        "heads": [
            {"task": str(task), "tenant": str(tenant), "seq": seq, "hash": head} for task, tenant, seq, head in heads
        ],
    }
    anchor = {**body, "kid": key_id(secret), "signature": _signature(body, secret)}
    key = f"{ANCHOR_PREFIX}/{now:%Y/%m/%d/%H%M%S}-{uuid.uuid4().hex[:8]}.json"
    (store or blob_store()).put(key, json.dumps(anchor, indent=1).encode(), "application/json")
    # Marked only once the object is stored: a crash in between anchors the same heads again
    # next time, which is harmless. Greatest: a record committed meanwhile stays unanchored.
    Task.objects.filter(id__in=[h[0] for h in heads]).update(
        audit_anchored_seq=Greatest(
            "audit_anchored_seq",
            Case(*[When(id=task, then=Value(seq)) for task, _, seq, _ in heads], output_field=IntegerField()),
        )
    )
    return key


def verify_anchors(
    *,
    store: BlobStore | None = None,
    task_id: str | None = None,
    since: datetime | None = None,
    grace: timedelta | None = None,
) -> tuple[int, list[BrokenLink]]:
    """Every anchor's signature, every anchored head against the records, and the records
    against the anchors (_check_coverage, with `grace`: anchor_grace() by default): (anchors
    checked, problems). `since` skips older anchors and records (after deleting old tasks by
    retention policy)."""
    store = store or blob_store()
    keys = _verification_keys()
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=UTC)  # an anchor's time has its zone: a bare --since means UTC
    checked, problems, coverage = 0, [], Coverage()
    for name in store.list(ANCHOR_PREFIX):
        try:
            anchor = json.loads(store.get(name))
            if not isinstance(anchor, dict):
                raise ValueError("not a JSON object")
            body = {k: v for k, v in anchor.items() if k not in ("kid", "signature")}
            taken_at = datetime.fromisoformat(str(body["taken_at"]))
            if taken_at.tzinfo is None:
                raise ValueError("taken_at has no time zone")
        except (ValueError, KeyError, RecursionError) as exc:
            # Not written by anchor_heads: planted or mangled in the blob store. Named, and the
            # other anchors are still checked (a verifier that stops here hides what they catch).
            checked += 1
            problems.append(BrokenLink("", None, f"anchor {name}: not an anchor ({type(exc).__name__}: {exc})"))
            continue
        skipped = since is not None and taken_at < since
        checked += 0 if skipped else 1
        secret = keys.get(anchor.get("kid", ""))
        if skipped:  # its heads still count as anchored if it verifies
            if secret is not None and hmac.compare_digest(_signature(body, secret), str(anchor.get("signature"))):
                coverage.add(taken_at, body["heads"])
            continue
        if secret is None:
            problems.append(
                BrokenLink(
                    "",
                    None,
                    f"anchor {name}: signed with unknown key {anchor.get('kid')!r} "
                    "(a retired key missing from RUNTIME_AUDIT_RETIRED_KEYS?)",
                )
            )
            continue
        if not hmac.compare_digest(_signature(body, secret), str(anchor.get("signature"))):
            problems.append(BrokenLink("", None, f"anchor {name}: signature does not verify (anchor edited)"))
            continue
        coverage.add(taken_at, body["heads"])
        heads = [h for h in body["heads"] if task_id is None or h["task"] == str(task_id)]
        problems.extend(_check_heads(name, heads))
    if settings.RUNTIME_AUDIT_KEY:  # without a key nothing is anchored (verify_audit warns)
        problems.extend(
            _check_coverage(coverage, anchor_grace() if grace is None else grace, task_id=task_id, since=since)
        )
    return checked, problems


def _check_coverage(
    coverage: Coverage, grace: timedelta, *, task_id: str | None, since: datetime | None
) -> list[BrokenLink]:
    """The gaps a database writer leaves by keeping chains from being anchored:

    1. a task whose audit_anchored_seq (what anchor_heads reads to skip a chain) is beyond
       what any anchor holds for it: the marker was moved, not by an anchor;
    2. a record that is in no anchor although it should be by now: stamped before the newest
       complete anchor was taken (less COMMIT_SLACK), or longer ago than `grace` (anchoring
       stopped, or the marker was moved and moved back). Its chain could be rewritten
       without a trace, so it is reported, with the first such record.
    """
    tasks, records = Task.objects.all(), AuditRecord.objects.all()
    if task_id is not None:
        tasks, records = tasks.filter(id=task_id), records.filter(task_id=task_id)
    if since is not None:
        records = records.filter(created_at__gte=since)
        tasks = tasks.filter(Exists(records.filter(task_id=OuterRef("id"))))
    problems = []
    for task, marked in tasks.filter(audit_anchored_seq__gt=0).values_list("id", "audit_anchored_seq"):
        held = coverage.anchored.get(str(task), 0)
        if marked > held:
            problems.append(
                BrokenLink(
                    str(task),
                    marked,
                    f"marked anchored, but the anchors hold {f'up to record {held}' if held else 'none of it'} "
                    "(the anchoring marker was moved: anchoring suppressed)",
                )
            )
    cutoff, why = timezone.now() - grace, f"more than {grace.total_seconds():g}s ago"
    if coverage.newest_complete is not None and coverage.newest_complete - COMMIT_SLACK > cutoff:
        cutoff = coverage.newest_complete - COMMIT_SLACK
        why = f"before the anchor of {coverage.newest_complete.isoformat()}"
    due = records.filter(created_at__lte=cutoff).values("task_id").annotate(last=Max("seq")).order_by("task_id")
    for row in due:
        held = coverage.anchored.get(str(row["task_id"]), 0)
        if row["last"] > held:
            first = records.filter(task_id=row["task_id"], seq=held + 1).values_list("created_at", flat=True).first()
            when = f"written {first.isoformat()}, " if first else ""
            problems.append(
                BrokenLink(
                    str(row["task_id"]),
                    held + 1,
                    f"in no anchor ({when}{why}): anchoring was stopped or suppressed",
                )
            )
    return problems


def _check_heads(anchor: str, heads: list[dict[str, Any]]) -> list[BrokenLink]:
    task_ids = {h["task"] for h in heads}
    stored = {
        (str(t), seq): hash_
        for t, seq, hash_ in AuditRecord.objects.filter(
            task_id__in=task_ids, seq__in={h["seq"] for h in heads}
        ).values_list("task_id", "seq", "hash")
    }
    existing = {
        str(t): str(tenant) for t, tenant in Task.objects.filter(id__in=task_ids).values_list("id", "tenant_id")
    }
    problems = []
    for head in heads:
        task, seq = head["task"], head["seq"]
        found = stored.get((task, seq))
        if task not in existing:
            problems.append(BrokenLink(task, seq, f"task deleted (anchored in {anchor})"))
        elif existing[task] != str(head["tenant"]):
            # The chain cannot tell: the tenant is not hashed. The anchor can.
            problems.append(
                BrokenLink(
                    task,
                    seq,
                    f"task now of tenant {existing[task]}, anchored in {anchor} as tenant {head['tenant']}'s (moved)",
                )
            )
        elif found is None:
            problems.append(BrokenLink(task, seq, f"deleted (anchored in {anchor})"))
        elif found != head["hash"]:
            problems.append(BrokenLink(task, seq, f"differs from its anchor {anchor} (chain rewritten)"))
    return problems
