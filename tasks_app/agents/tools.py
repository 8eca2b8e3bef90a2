"""The tool registry: what `ctx.tool(name, args)` may name (DESIGN §6).

Only the registry lives here, beside the agent SDK; the implementations (HTTP, publish,
email, remote MCP) are in ledger_app.tools, and a call with an external effect only ever
happens through ledger_app.actions.execute_once, which commits a ledger row first and
passes the row's key to the remote as its idempotency key."""

from __future__ import annotations

import email.utils
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tasks_app.redaction import tool_text


class ToolError(Exception):
    """A tool's failure. Its message often quotes the remote (an error body echoing the
    payload), so it is masked and bounded here, before it becomes a reason, a ledger
    error, an event or a log line."""

    def __init__(self, message: str, *, retryable: bool, retry_after: float | None = None) -> None:
        super().__init__(tool_text(message))
        self.retryable = retryable
        self.retry_after = retry_after  # seconds the remote asked us to wait (429/503 Retry-After)


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The wait a remote asked for, in seconds: `Retry-After` as seconds or an HTTP date
    (RFC 9110 §10.2.3), or OpenAI's `retry-after-ms`; None when absent or unreadable."""
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            seconds = float(ms) / 1000
        elif (value := headers.get("retry-after")) is None:
            return None
        elif value.strip().isdigit():
            seconds = float(value)
        else:
            seconds = (email.utils.parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds()
    except (TypeError, ValueError, OverflowError):
        return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


# What a reconcile hook may answer about a call made by an earlier run.
DONE, NOT_DONE = "done", "not_done"
# What a step gets from a call a person (or an operator) confirmed as done: the remote's
# answer was lost with the worker that made it, and a null would pass for that answer
# (a task once completed with `null` where the remote's answer belonged, issue 12 #4).
ANSWER_LOST = {"reconciled": True, "answerLost": True}


@dataclass(frozen=True)
class Pending:
    """A call (or poll) answer: the remote took the call as a long-running task of its own.
    The ledger stores `ref` and polls it; the call itself is never made again."""

    ref: str
    message: str = ""
    poll_after: float = 1.0  # seconds; the remote's suggestion where it made one


@dataclass(frozen=True)
class Tool:
    name: str
    input_schema: dict[str, Any]
    call: Callable[[dict[str, Any], str, float], Any]  # (args, idempotency key, timeout) -> result
    # False: the call changes nothing outside (a model call); one cut by a kill or lost with
    # a worker is sent again, never reconciled or put to a person (ledger_app.actions).
    side_effect: bool = True
    timeout: float = 10.0
    retries: int = 2  # after the first attempt; bounded
    backoff: float = 0.2  # seconds, doubled per retry
    # (args, key) -> (DONE, result) | (NOT_DONE, None); None (or the hook raising) means it cannot tell
    reconcile: Callable[[dict[str, Any], str], tuple[str, Any] | None] | None = None
    # (args, remote ref, timeout) -> result | Pending: for tools whose call may answer Pending
    poll: Callable[[dict[str, Any], str, float], Any] | None = None
    # (args, idempotency key) -> None: what the input schema cannot say about arguments the
    # call would refuse or mangle (a URL that does not parse, a header with a line break, a
    # blob that is not the task's own). Raises ToolError(retryable=False); the ledger asks
    # before anything is recorded or put to an approver, so a refused call leaves no row.
    check: Callable[[dict[str, Any], str], None] | None = None


_TOOLS: dict[str, Tool] = {}


def before_send() -> None:
    """For a tool's `call`, a plugin's too: call it right before the bytes go out, after any
    slow preparation (connecting, rendering, waiting for a slot); let what it raises through.
    It raises when the lease confirmed for this call has run out since: the worker was frozen
    (SIGSTOP, a paused container) and may have been taken over, and the new owner, finding the
    call's ledger row started, may have sent it already. The ledger checks the same once more
    as it hands the call over, so a call that sends at once needs nothing. Outside a call (a
    reconcile's read) it checks nothing."""
    _send_guard()


def _unguarded() -> None:
    return None


# What before_send asks: leases.still_confirmed, set by ledger_app.tools (this SDK sits below
# the lease machinery in the layers).
_send_guard: Callable[[], None] = _unguarded


def guard_sends(check: Callable[[], None]) -> None:
    global _send_guard  # noqa: PLW0603 (set once, at import, by the layer that owns leases)
    _send_guard = check


class UnknownTool(LookupError):
    pass


def register(tool: Tool) -> Tool:
    _TOOLS[tool.name] = tool
    return tool


# The brief's names for the guarded tools (its approvalPolicy example), accepted in policies.
ALIASES = {"send_email": "email.send", "publish_report": "content.publish"}


def get_tool(name: str) -> Tool:
    try:
        return _TOOLS[name]
    except KeyError:
        raise UnknownTool(f"no tool named {name!r}") from None


def tool_names() -> list[str]:
    return sorted(_TOOLS)
