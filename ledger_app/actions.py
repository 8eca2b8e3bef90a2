"""Execute-once (DESIGN §6, STYLE 2.5): steps are scheduled at least once; effects happen once.

key = task:step:call-index
succeeded row    → the stored result, no call
started/unknown  → a previous run may have called: ask the tool's reconcile hook by key;
                   without an answer, a person confirms (an input request); never re-run blindly
no row           → commit a started row (fenced), call with the key as idempotency key
                   and bounded retries, settle succeeded or failed (fenced)
pending          → the remote answered with a task of its own, whose id (remote_ref) was
                   committed: poll it — in this slice for a while, then from later slices
                   (agents.RemoteWait), after restarts too — and settle when it ends
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from common.canonical import canonical_json, sha256_hex
from common.schema import validate
from ledger_app import llm
from ledger_app.models import EffectStatus, LedgerEntry
from tasks_app import faults, kills, leases, policy, quotas
from tasks_app.agents import base as agents
from tasks_app.agents import tools
from tasks_app.agents.questions import Answers, QuestionKind, approval_key, confirmation_key
from tasks_app.models import Task
from tasks_app.redaction import redact

logger = logging.getLogger(__name__)
# The longest a retry waits on a remote's Retry-After inside a step (seconds).
RETRY_AFTER_CAP = 30.0


class ToolFailed(agents.ToolFailure):
    """The call failed for good (permanent error, or retries used up); the step fails with this."""

    code = "tool_failed"  # the task's error code


class QuotaExhausted(ToolFailed):
    """The tenant's daily quota is used up and limits.on_quota is fail: the task fails."""

    code = "quota_exceeded"


def _crash_here(point: str) -> None:
    """Fault injection for the crash tests (RUNTIME_FAULT_INJECTION="<point>:<marker file>"):
    the process dies like a kill -9, once (the marker file remembers). With "freeze:<point>:
    <marker file>" it stops itself instead (SIGSTOP, as if the OS paused it) and the marker
    holds its pid, for the test to thaw it. With "hang:<point>:<marker file>" it hangs in
    a C call that never lets go of the GIL (a regular expression backtracking for ever),
    as a step stuck in a native library would."""
    spec = os.getenv("RUNTIME_FAULT_INJECTION", "")
    mode, _, rest = spec.partition(":")
    if mode not in ("freeze", "hang"):
        mode, rest = "crash", spec
    if rest.startswith(point + ":"):
        marker = Path(rest[len(point) + 1 :])
        if not marker.exists():
            marker.write_text(str(os.getpid()) if mode != "crash" else point)
            if mode == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif mode == "hang":
                re.fullmatch(r"(a+)+b", "a" * 64)  # 2**64 steps in _sre, which holds the GIL throughout
            else:
                os._exit(137)


def settle_interrupted(task_id: Any, *, before_epoch: int) -> int:
    """At a new lease, or a kill: rows a lost or cut call left started are unknown now (it
    may have called). Not a tool without side effects (Tool.side_effect, e.g. llm.chat):
    whatever it did changed nothing outside, so its row stays started and the re-run step
    simply sends it again, with nothing to reconcile and nobody to ask.

    Only rows started under a lease epoch older than `before_epoch`: a slice's load passes
    its own epoch. Rows of that epoch or a newer one are not the caller's to settle: a
    worker stopped right after its claim and run again after a takeover loads (and settles)
    all the same, and the new owner's call in flight, started under the newer epoch, is
    neither lost nor cut. Its other writes are fenced; this one is too, by the epoch."""
    return (
        LedgerEntry.objects.filter(task_id=task_id, status=EffectStatus.STARTED, lease_epoch__lt=before_epoch)
        .exclude(tool__in=harmless_tools())
        .update(status=EffectStatus.UNKNOWN)
    )


def harmless_tools() -> list[str]:
    """Tools without side effects, whose started rows settle_interrupted leaves alone."""
    return [name for name in tools.tool_names() if not tools.get_tool(name).side_effect]


# A kill cuts the step only inside the remote call itself, where the Kill Policy lets it
# (kills.calling); the ledger's own reads and writes run to their end.
@kills.shielded()
def execute_once(
    lease: leases.Lease,
    *,
    tenant_id: int,
    sequence: int,
    index: int,
    name: str,
    args: dict[str, Any],
    answers: dict[str, Any],
) -> Any:
    if reason := policy.denial(name):
        raise ToolFailed(reason)
    tool = tools.get_tool(name)
    validate(args, tool.input_schema, f"{name} arguments")
    key = f"{lease.task_id}:{sequence}:{index}"
    fingerprint = sha256_hex(canonical_json(args))
    entry = LedgerEntry.objects.filter(key=key).first()
    if entry is not None:
        if entry.fingerprint != fingerprint:
            raise ToolFailed(f"call {key} was made before with other arguments (the agent is not deterministic)")
        if entry.status == EffectStatus.SUCCEEDED:
            return entry.result  # replay: done already
        if entry.status == EffectStatus.FAILED:
            assert entry.error is not None  # every failed entry is stored with its error
            raise ToolFailed(entry.error["message"])
        if entry.status == EffectStatus.PENDING:
            return _poll_and_settle(lease, entry, tool, args)
        if _reconciled(lease, entry, tool, args, answers):
            return LedgerEntry.objects.get(id=entry.id).result
        # The remote says it never happened: the call is safe to make (under the same key).
        _guard(lease, tool, key, args, answers)
        with transaction.atomic(durable=True):
            leases.fenced_update(lease)
            # Started again, under this lease: a kill now sees the call in flight and waits
            # for one that must finish (steering_app.actions), as for a first send.
            LedgerEntry.objects.filter(id=entry.id).update(status=EffectStatus.STARTED, lease_epoch=lease.epoch)
    else:
        _guard(lease, tool, key, args, answers)
        with _quota_refusal(), transaction.atomic(durable=True):
            leases.fenced_update(lease)  # a zombie commits no ledger row either
            # Counted with the row, in its transaction: exactly once, whatever crashes when.
            quotas.take_tool_call(tenant_id)
            entry = LedgerEntry.objects.create(
                tenant_id=tenant_id,
                task_id=lease.task_id,
                step_sequence=sequence,
                call_index=index,
                key=key,
                tool=name,
                fingerprint=fingerprint,
                status=EffectStatus.STARTED,
                lease_epoch=lease.epoch,
            )
    _crash_here("ledger:before_call")
    return _call_and_settle(lease, entry, tool, args)


@contextlib.contextmanager
def _quota_refusal() -> Iterator[None]:
    """A used-up daily quota (tasks_app/quotas.py), as limits.on_quota says: wait (the slice
    yields and a later one tries the call again, as for a remote task) or fail the task."""
    try:
        yield
    except quotas.QuotaReached as exc:
        if quotas.on_quota() == quotas.WAIT:
            raise agents.RemoteWait(f"{exc}; waiting (limits.on_quota: wait)") from exc
        raise QuotaExhausted(str(exc)) from exc


def _guard(lease: leases.Lease, tool: tools.Tool, key: str, args: dict[str, Any], answers: dict[str, Any]) -> None:
    """Before a call is recorded: the tool's own check of its arguments (Tool.check), then
    the policy. Refused or denied → ToolFailed, with no row and no retry; guarded → an
    approver's answer, or wait for one (the task checkpoints and goes to input_required
    before the call). Nobody is asked to approve a call the tool would refuse."""
    if tool.check is not None:
        try:
            tool.check(args, key)
        except tools.ToolError as exc:
            raise ToolFailed(f"{tool.name}: {exc}") from exc
    task = Task.objects.values("approval_policy", "budget", "steps_done", "started_at", "cost").get(id=lease.task_id)
    budget = policy.effective_budget(task["budget"], answers)
    counted = "maxToolCalls" in budget  # the guard's only scans: tool calls and model tokens, when limited
    usage = policy.Usage(
        steps=task["steps_done"],
        tool_calls=LedgerEntry.objects.filter(task_id=lease.task_id).count() if counted else None,
        wall_seconds=(timezone.now() - task["started_at"]).total_seconds() if task["started_at"] else 0.0,
        cost=task["cost"],
        tokens=llm.tokens_used(lease.task_id) if "maxTokens" in budget else None,
    )
    decision = policy.decide(
        tool.name, approval_policy=task["approval_policy"], budget=task["budget"], usage=usage, answers=answers
    )
    if decision.verdict == policy.EXHAUSTED:
        if question := policy.budget_question(f"call-{key}", decision.reason, answers):
            raise question
        raise ToolFailed(decision.reason)
    if decision.verdict == policy.DENY:
        raise ToolFailed(decision.reason)
    if decision.verdict == policy.NEEDS_APPROVAL:
        answer = Answers.of(answers).approval(key)
        if answer == "reject":
            raise agents.ToolRejected(f"{tool.name} was rejected by an approver")
        if answer != "approve":
            summary = canonical_json(redact(args))
            raise agents.InputNeeded(
                approval_key(key),
                f"Approve {tool.name} with {summary[:400]}{'...' if len(summary) > 400 else ''}?",
                {"enum": ["approve", "reject"]},
                kind=QuestionKind.APPROVAL,
            )


def _reconciled(
    lease: leases.Lease, entry: LedgerEntry, tool: tools.Tool, args: dict[str, Any], answers: dict[str, Any]
) -> bool:
    """True: settled as succeeded (the remote, or a person, says it happened). False: it did
    not happen. Raises InputNeeded when nobody can tell."""
    if not tool.side_effect:
        return False  # it changed nothing outside: send it again, nobody need tell
    verdict = None
    if tool.reconcile is not None:
        try:
            verdict = tool.reconcile(args, entry.key)
        except Exception as exc:  # noqa: BLE001 (a tool's own hook: whatever it raises, we cannot tell, as without one)
            logger.warning("reconcile of %s failed: %s", entry.key, exc)
    confirm_key = confirmation_key(entry.key)
    if verdict is None and Answers.of(answers).answered(confirm_key, QuestionKind.CONFIRMATION):
        verdict = (tools.DONE, tools.ANSWER_LOST) if answers[confirm_key] == "done" else (tools.NOT_DONE, None)
    if verdict is None:
        with transaction.atomic(durable=True):
            leases.fenced_update(lease)
            LedgerEntry.objects.filter(id=entry.id).update(status=EffectStatus.UNKNOWN)
        raise agents.InputNeeded(
            confirm_key,
            f"A {entry.tool} call (key {entry.key}) may or may not have taken effect before a worker was lost, "
            "and the remote cannot be asked. Check it, then answer 'done' or 'not_done'.",
            {"enum": [tools.DONE, tools.NOT_DONE]},
            kind=QuestionKind.CONFIRMATION,
        )
    if verdict[0] == tools.DONE:
        _settle(lease, entry, EffectStatus.SUCCEEDED, result=verdict[1])
        return True
    return False


def _call_and_settle(lease: leases.Lease, entry: LedgerEntry, tool: tools.Tool, args: dict[str, Any]) -> Any:
    durations: list[float] = []
    delay = tool.backoff
    for attempt in range(1, tool.retries + 2):
        t0 = time.perf_counter()
        try:
            # Still ours, right before the bytes go out (the tool's client checks it again as
            # it sends: leases.still_confirmed).
            with leases.sending(lease), kills.calling(tool.name):
                _crash_here("ledger:confirmed")
                # ... and as the call is handed over: a tool whose client does not check (a
                # plugin's; tools.before_send is theirs to call) is never handed a call whose
                # confirmed lease ran out while this worker was frozen since confirming it.
                leases.still_confirmed()
                t0 = time.perf_counter()
                result = tool.call(args, entry.key, tool.timeout)
        except tools.ToolError as exc:
            durations.append(round((time.perf_counter() - t0) * 1000, 1))
            if exc.retryable and attempt <= tool.retries:
                # A remote that said how long to wait (429/503 Retry-After) is asked no sooner,
                # but a step holds its worker meanwhile: past the cap the retry goes anyway.
                wait = min(max(delay, exc.retry_after or 0.0), RETRY_AFTER_CAP)
                logger.info("%s attempt %s failed (%s); retrying in %.1fs", entry.key, attempt, exc, wait)
                time.sleep(wait)
                delay *= 2
                continue
            error: dict[str, Any] = {"message": f"{tool.name}: {exc}", "retryable": exc.retryable, "attempts": attempt}
            _settle(lease, entry, EffectStatus.FAILED, error=error, attempts=attempt, durations=durations)
            raise ToolFailed(error["message"] + f" (after {attempt} attempt{'s' * (attempt > 1)})") from exc
        durations.append(round((time.perf_counter() - t0) * 1000, 1))
        _crash_here("ledger:after_call")
        if isinstance(result, tools.Pending):
            _settle(lease, entry, EffectStatus.PENDING, remote_ref=result.ref, attempts=attempt, durations=durations)
            _crash_here("ledger:after_remote_task")
            entry.remote_ref = result.ref
            return _poll_and_settle(lease, entry, tool, args, first=result)
        _settle(lease, entry, EffectStatus.SUCCEEDED, result=result, attempts=attempt, durations=durations)
        _crash_here("ledger:after_settle")
        return result
    raise AssertionError("unreachable")


def _poll_and_settle(
    lease: leases.Lease, entry: LedgerEntry, tool: tools.Tool, args: dict[str, Any], first: tools.Pending | None = None
) -> Any:
    """Poll the remote task for up to tools.remote_wait_seconds; then give the worker back
    (agents.RemoteWait: the slice yields and a later one polls again). Transient poll
    errors are not the call failing: they are recorded and the next slice asks again."""
    assert tool.poll is not None, f"{tool.name} answered Pending but has no poll hook"
    deadline = time.monotonic() + float(settings.RUNTIME["tools"]["remote_wait_seconds"])
    answer: Any = first
    while True:
        if answer is not None:
            if not isinstance(answer, tools.Pending):
                _settle(lease, entry, EffectStatus.SUCCEEDED, result=answer)
                return answer
            if time.monotonic() + answer.poll_after > deadline:
                raise agents.RemoteWait(
                    f"{tool.name}: {answer.message or 'remote task running'} (task {entry.remote_ref})",
                    poll_after=answer.poll_after,
                )
            with kills.calling(tool.name):
                time.sleep(answer.poll_after)
        try:
            with kills.calling(tool.name):
                answer = tool.poll(args, entry.remote_ref, tool.timeout)
        except tools.ToolError as exc:
            if not exc.retryable:
                error = {"message": f"{tool.name}: {exc}", "retryable": False, "remoteRef": entry.remote_ref}
                _settle(lease, entry, EffectStatus.FAILED, error=error)
                raise ToolFailed(error["message"]) from exc
            _settle(
                lease,
                entry,
                EffectStatus.PENDING,
                error={"message": f"polling {entry.remote_ref}: {exc}", "retryable": True},
            )
            raise agents.RemoteWait(f"{tool.name}: polling failed, will retry: {exc}") from exc


def _settle(
    lease: leases.Lease,
    entry: LedgerEntry,
    status: str,
    *,
    result: Any = None,
    error: dict[str, Any] | None = None,
    attempts: int | None = None,
    durations: list[float] | None = None,
    remote_ref: str | None = None,
) -> None:
    """Write the remote's answer, fenced. The answer is in hand only here: lost to an
    infrastructure fault (the connection cut while the call was out), the row stays started,
    the next slice finds it unknown and, with a remote that cannot be asked, a person must
    confirm a call whose answer we had. So the write is tried again on a fresh connection,
    at once and then after a backoff, for as long as a lease: the fence still decides (a
    lease taken over meanwhile raises LeaseLost, and the new holder settles the row)."""
    fields: dict[str, Any] = {"status": status, "result": result, "error": redact(error) if error else None}
    if remote_ref is not None:
        fields["remote_ref"] = remote_ref
    if attempts is not None:
        fields.update(attempts=entry.attempts + attempts, durations_ms=entry.durations_ms + (durations or []))
    give_up = time.monotonic() + settings.RUNTIME_LEASE_SECONDS
    for tried in itertools.count():
        try:
            with transaction.atomic(durable=True):
                leases.fenced_update(lease)
                LedgerEntry.objects.filter(id=entry.id).update(**fields)
            return
        except Exception as exc:
            if not faults.is_infrastructure_error(exc):
                raise
            faults.drop_connection()  # the next try connects afresh
            wait = faults.backoff(tried) if tried else 0.0
            if time.monotonic() + wait > give_up:
                raise  # the database stays away: the slice is abandoned, the row left started
            logger.warning("%s: its answer could not be written (%s); trying again in %.1fs", entry.key, exc, wait)
            time.sleep(wait)
