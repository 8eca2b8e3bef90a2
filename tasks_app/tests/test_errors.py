"""tasks_app.errors: one table of domain errors, read the same way by REST and MCP (in-process)."""

from __future__ import annotations

import uuid

import pytest

from common.json_safety import UnsafeInput
from common.schema import SchemaError
from mcp_server.shared import rpc_error
from runtime_site.errors import exception_handler
from tasks_app import errors
from tasks_app.agents.base import UnknownAgent

SAMPLES = [
    errors.TaskNotFound(),
    errors.Forbidden("this needs the operator role or above", role="operator"),
    errors.IllegalTransition("completed", "cancelled"),
    errors.IdempotencyConflict(uuid.uuid4()),
    errors.QuotaExceeded("this tenant already has 3 queued tasks"),
    errors.NoLease(uuid.uuid4()),
    errors.CommandRefused("the task is completed; it takes no more commands"),
    errors.InvalidCommand("payload: goal is not a string"),
    UnknownAgent("nope"),
    SchemaError("input: steps is not an integer"),
]


@pytest.mark.parametrize("exc", SAMPLES, ids=lambda e: type(e).__name__)
def test_rest_and_mcp_answer_a_domain_error_as_the_table_says(exc):
    answer = errors.answer_for(exc)
    assert answer is not None
    response = exception_handler(exc, {})
    assert response is not None
    assert response.status_code == answer.http_status
    assert response.data == {"error": {"code": answer.code, "message": errors.message(exc)}}
    rpc = rpc_error(exc)
    assert rpc.code == answer.rpc_code and rpc.message == errors.rpc_message(exc, answer)


def test_the_mcp_wording_of_the_errors_it_always_had():
    assert rpc_error(errors.TaskNotFound()).message == "Failed to retrieve task: Task not found"
    forbidden = rpc_error(errors.Forbidden("this needs the operator role or above"))
    assert (forbidden.code, forbidden.http_status) == (-32600, 403)
    assert forbidden.message == "Forbidden: this needs the operator role or above"
    assert rpc_error(UnsafeInput("payload.goal", "a NUL character")).message.startswith("Invalid params: ")
    assert errors.tool_message(SchemaError("input: bad")) == "invalid arguments: input: bad"
    assert errors.tool_message(errors.CommandRefused("no")) == "refused: no"


def test_a_subclass_is_answered_as_itself_not_as_its_base():
    class Command:
        payload = {"answer": "approve"}
        requested_by = "user:1"

    conflict = errors.AnswerConflict("approve-x", Command())  # type: ignore[arg-type]
    assert errors.answer_for(conflict).code == "answer_conflict"
    assert errors.answer_for(errors.CommandRefused("no")).code == "command_refused"
