"""Domain errors and the one table of what each edge answers for them (docs/architecture.md,
"Layers"): REST's status and code (runtime_site/errors.py), MCP's JSON-RPC code and message
(mcp_server/shared.py), the text of an MCP tool error and of a dashboard flash.

Actions raise these and never build responses; an edge looks an error up here. The
exceptions live here, below every app that raises them, so the table can name them all;
import them from here (the actions that raise them import them too, but only to raise them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from uuid import UUID

from common.json_safety import UnsafeInput
from common.schema import SchemaError
from tasks_app.agents.base import UnknownAgent

if TYPE_CHECKING:
    from steering_app.models import SteeringCommand
    from tasks_app.models import Task


class TaskNotFound(Exception):
    """No such task for this caller: another tenant's task, a malformed id and a missing
    task are the same answer, so ids leak nothing."""

    def __init__(self, message: str = "no such task") -> None:
        super().__init__(message)


class Forbidden(Exception):
    """The caller's role (or its key's scopes) does not allow this; the message says why,
    and `role` names the role it needs when that is the reason."""

    def __init__(self, message: str, *, role: str | None = None) -> None:
        super().__init__(message)
        self.role = role


class IllegalTransition(Exception):
    def __init__(self, from_status: str, to_status: str) -> None:
        super().__init__(f"a {from_status} task cannot become {to_status}")
        self.from_status, self.to_status = from_status, to_status


class IdempotencyConflict(Exception):
    def __init__(self, task_id: UUID) -> None:
        super().__init__("this Idempotency-Key was already used with a different request body")
        self.task_id = task_id


class QuotaExceeded(Exception):
    """The tenant is at a configured cap (limits.queued_tasks_per_tenant): HTTP 429."""


class NoLease(Exception):
    def __init__(self, task_id: UUID) -> None:
        super().__init__("the task holds no lease")
        self.task_id = task_id


class VersionConflict(Exception):
    def __init__(self, task: Task) -> None:
        super().__init__(f"someone changed this task: its version is now {task.state_version}")
        self.task = task


class CommandRefused(Exception):
    """The command cannot apply to the task as it is now (HTTP 409, with the task's snapshot)."""

    def __init__(self, message: str, task: Task | None = None) -> None:
        super().__init__(message)
        self.task = task


class InvalidCommand(Exception):
    """The payload does not fit the command (HTTP 422)."""


class AnswerConflict(CommandRefused):
    """The input request already has an answer, applied or accepted and pending: it stands,
    and a different one is refused with it (HTTP 409), on every edge."""

    def __init__(self, key: str, command: SteeringCommand) -> None:
        shown = json.dumps(command.payload["answer"])
        super().__init__(
            f"input request {key!r} already has the answer {shown[:200]} (from {command.requested_by}); it stands"
        )
        self.key, self.command = key, command

    @property
    def answer(self) -> Any:
        return self.command.payload["answer"]


# JSON-RPC 2.0's codes (the MCP edge's protocol module names the same numbers).
INVALID_REQUEST, INVALID_PARAMS = -32600, -32602


@dataclass(frozen=True)
class ErrorAnswer:
    """What the edges answer for one domain error. The texts are formats of the error's
    message (`{message}`; `{exc}` is the exception, for the data it carries)."""

    code: str  # REST's error.code
    http_status: int  # REST's status (and MCP's, where `rpc_http_status` says so)
    rpc_code: int = INVALID_PARAMS  # an MCP request refused with it
    rpc_message: str = "{message}"
    rpc_http_status: int | None = None  # None: the JSON-RPC code's usual HTTP status
    tool_message: str = "refused: {message}"  # an MCP tool call (isError) refused with it


# Most specific first: an edge takes the first entry the exception is an instance of.
DOMAIN_ERRORS: dict[type[Exception], ErrorAnswer] = {
    UnsafeInput: ErrorAnswer("invalid_request", 400, rpc_message="Invalid params: {message}"),
    TaskNotFound: ErrorAnswer("not_found", 404, rpc_message="Failed to retrieve task: Task not found"),
    Forbidden: ErrorAnswer("permission_denied", 403, INVALID_REQUEST, "Forbidden: {message}", rpc_http_status=403),
    UnknownAgent: ErrorAnswer("unknown_agent", 422, rpc_message="Unknown tool: {exc.args[0]}"),
    SchemaError: ErrorAnswer("invalid_input", 422, tool_message="invalid arguments: {message}"),
    IdempotencyConflict: ErrorAnswer("idempotency_key_reused", 422, tool_message="{message}"),
    QuotaExceeded: ErrorAnswer("quota_exceeded", 429, tool_message="{message}"),
    VersionConflict: ErrorAnswer(
        "version_conflict",
        409,
        tool_message="version conflict: {message}; read the task again (currentVersion "
        "{exc.task.state_version}) and retry with that expectedVersion",
    ),
    AnswerConflict: ErrorAnswer("answer_conflict", 409),
    IllegalTransition: ErrorAnswer("illegal_transition", 409),
    CommandRefused: ErrorAnswer("command_refused", 409),
    InvalidCommand: ErrorAnswer("invalid_payload", 422),
    NoLease: ErrorAnswer("no_lease", 409),
}

DomainError = tuple(DOMAIN_ERRORS)  # `except DomainError` catches every error in the table


def answer_for(exc: BaseException) -> ErrorAnswer | None:
    for kind, answer in DOMAIN_ERRORS.items():
        if isinstance(exc, kind):
            return answer
    return None


def message(exc: BaseException) -> str:
    """The error's message as every edge shows it."""
    if isinstance(exc, UnknownAgent):
        return f"unknown agent {exc.args[0]!r}"
    return str(exc)


def rpc_message(exc: BaseException, answer: ErrorAnswer) -> str:
    return answer.rpc_message.format(message=str(exc), exc=exc)


def tool_message(exc: BaseException) -> str:
    answer = answer_for(exc)
    return answer.tool_message.format(message=str(exc), exc=exc) if answer else str(exc)
