"""The fixture tools the official MCP conformance suite calls by name, as real agents.

Registered only when settings.RUNTIME_MCP_FIXTURES is on (tests, the conformance run):
they run on the same engine and workers as every other agent, so the suite exercises
durable creation, input_required, cancellation at a safe point and failure for real.

Each declares how it shows on /mcp as `mcp = McpOptions(...)` (task support, client
capabilities, MRTR preflight questions) and its CallToolResult with mcp_tool_result(result)
(tasks_app/agents/base.py, docs/mcp.md).
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar

from tasks_app.agents.base import Agent, McpOptions, StepContext, register

_TEXT_OUTPUT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


class _OneStep(Agent):
    """One step that computes the result text from the input."""

    output_schema: ClassVar[dict[str, Any]] = _TEXT_OUTPUT

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"input": input, "text": None}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return None if state["text"] is not None else self.name

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "text": self.text(ctx, state["input"])}

    def text(self, ctx: StepContext, input: dict[str, Any]) -> str:
        raise NotImplementedError

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"text": state["text"]}

    def mcp_tool_result(self, result: dict[str, Any]) -> dict[str, Any]:
        return {"content": [{"type": "text", "text": result["text"]}], "isError": False}


@register
class Greet(_OneStep):
    name = "greet"
    description = "Greets someone by name (synchronous; never a task)."
    input_schema: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 200}}, "required": ["name"]}
    mcp = McpOptions(task_support="forbidden")

    def text(self, ctx: StepContext, input: dict[str, Any]) -> str:
        return f"Hello, {input['name']}!"


@register
class SlowCompute(Agent):
    name = "slow_compute"
    description = "Works for `seconds` seconds in quarter-second steps, reporting progress; cancellable."
    input_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"seconds": {"type": "number", "minimum": 0, "maximum": 3600},
                       "label": {"type": "string", "maxLength": 200}},
    }
    output_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "seconds": {"type": "number"}, "steps": {"type": "integer"}},
        "required": ["text", "seconds", "steps"],
    }
    mcp = McpOptions(task_support="optional")
    STEP_SECONDS = 0.25

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        seconds = float(input.get("seconds", 1))
        return {"seconds": seconds, "label": input.get("label", ""), "done": 0,
                "total": math.ceil(seconds / self.STEP_SECONDS)}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return "compute" if state["done"] < state["total"] else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        time.sleep(state["seconds"] / state["total"])
        done = state["done"] + 1
        ctx.progress(done / state["total"], phase="compute", message=f"step {done}/{state['total']}")
        return {**state, "done": done}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        label = f" ({state['label']})" if state["label"] else ""
        return {"text": f"computed for {state['seconds']:g}s{label}", "seconds": state["seconds"],
                "steps": state["done"]}

    def mcp_tool_result(self, result: dict[str, Any]) -> dict[str, Any]:
        return {"content": [{"type": "text", "text": result["text"]}], "isError": False}


@register
class FailingJob(_OneStep):
    """A tool-level failure: the task completes, and its result says isError."""

    name = "failing_job"
    description = "Runs briefly, then reports a tool error (isError) as its result."
    input_schema: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def text(self, ctx: StepContext, input: dict[str, Any]) -> str:
        time.sleep(0.5)
        return "failing_job failed: the job could not finish (a tool error, not a protocol error)"

    def mcp_tool_result(self, result: dict[str, Any]) -> dict[str, Any]:
        return {"content": [{"type": "text", "text": result["text"]}], "isError": True}


@register
class ProtocolErrorJob(_OneStep):
    """A step that raises: the engine fails the task, which MCP shows as failed + error."""

    name = "protocol_error_job"
    description = "Raises inside its step; the task ends failed with a JSON-RPC error."
    input_schema: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def text(self, ctx: StepContext, input: dict[str, Any]) -> str:
        raise RuntimeError("protocol_error_job exploded")


_CONFIRM = {"type": "object", "properties": {"confirm": {"type": "boolean", "title": "Confirm"}},
            "required": ["confirm"]}


@register
class ConfirmDelete(_OneStep):
    name = "confirm_delete"
    description = "Asks for confirmation (input_required), then 'deletes' the file."
    input_schema: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {"filename": {"type": "string", "maxLength": 500}}}

    def text(self, ctx: StepContext, input: dict[str, Any]) -> str:
        filename = input.get("filename", "the file")
        answer = ctx.ask("confirm", f"Delete {filename}?", _CONFIRM)
        return f"deleted {filename}" if answer and answer.get("confirm") else f"kept {filename}"


@register
class MultiInput(_OneStep):
    name = "multi_input"
    description = "Asks two questions at once; finishes when both are answered."
    input_schema: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def text(self, ctx: StepContext, input: dict[str, Any]) -> str:
        answers = ctx.ask_all({"first": ("First confirmation?", _CONFIRM),
                               "second": ("Second confirmation?", _CONFIRM)})
        return "answers: " + ", ".join(f"{k}={bool(v and v.get('confirm'))}" for k, v in answers.items())


_NAME = {"type": "object", "properties": {"name": {"type": "string", "title": "Name"}}, "required": ["name"]}


@register
class ToolWithTask(_OneStep):
    name = "test_tool_with_task"
    description = "Asks for a name by MRTR before the task exists, then greets it from a task."
    input_schema: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 200}}}
    mcp = McpOptions(preflight={
        "user_name": {"message": "What is your name?", "requestedSchema": _NAME, "argument": "name",
                      "field": "name"}})

    def text(self, ctx: StepContext, input: dict[str, Any]) -> str:
        return f"Hello, {input.get('name', 'stranger')}! (from a task)"


@register
class MissingCapability(_OneStep):
    name = "test_missing_capability"
    description = "Needs the client's sampling capability; without it the call is refused with -32021."
    input_schema: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}
    mcp = McpOptions(task_support="forbidden", client_capabilities={"sampling": {}})

    def text(self, ctx: StepContext, input: dict[str, Any]) -> str:
        return "the client declared sampling"


@register
class StreamingElicitation(_OneStep):
    name = "test_streaming_elicitation"
    description = "Asks for a name through an InputRequiredResult (never a request on the stream)."
    input_schema: ClassVar[dict[str, Any]] = {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 200}}}
    mcp = McpOptions(task_support="forbidden", client_capabilities={"elicitation": {}}, preflight={
        "name": {"message": "What is your name?", "requestedSchema": _NAME, "argument": "name", "field": "name"}})

    def text(self, ctx: StepContext, input: dict[str, Any]) -> str:
        return f"elicited {input.get('name', '')}"


@register
class LoggingTool(_OneStep):
    name = "test_logging_tool"
    description = "Logs three lines to the task's event stream (never as MCP log notifications)."
    input_schema: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}
    mcp = McpOptions(task_support="forbidden")

    def text(self, ctx: StepContext, input: dict[str, Any]) -> str:
        for n in (1, 2, 3):
            ctx.log(f"log line {n}")
        return "logged 3 lines"
