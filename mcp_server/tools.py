"""The tool catalogue: every registered agent is a tool (its runs are Task rows), plus the
steering tools, which MCP has no verb for. Definitions only; shared.py runs them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tasks_app.agents import base as agents

FORBIDDEN, OPTIONAL, REQUIRED = "forbidden", "optional", "required"

_VERSIONED = {
    "taskId": {"type": "string", "description": "The task (its MCP taskId)."},
    "expectedVersion": {
        "type": "integer",
        "minimum": 1,
        "description": "The task's stateVersion as you last saw it (compare-and-set).",
    },
    "reason": {"type": "string", "maxLength": 500},
    "commandId": {
        "type": "string",
        "pattern": "^[A-Za-z0-9._:\\-]{1,64}$",
        "description": "Makes a retry idempotent; generated when omitted.",
    },
}
_STEERING_OUTPUT = {
    "type": "object",
    "properties": {
        "commandId": {"type": "string"},
        "type": {"type": "string"},
        "status": {"type": "string"},
        "version": {"type": "integer"},
        "outcome": {"type": "string"},
        "stateVersion": {"type": "integer"},
        "runtimeStatus": {"type": "string"},
    },
    "required": ["commandId", "type", "status", "version", "stateVersion"],
}


@dataclass(frozen=True)
class SteeringTool:
    name: str
    command: str  # steering_app CommandType
    description: str
    extra: dict[str, Any]  # input properties besides the versioned ones
    required: tuple[str, ...] = ()

    def definition(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "inputSchema": {
                "type": "object",
                "properties": {**_VERSIONED, **self.extra},
                "required": ["taskId", "expectedVersion", *self.required],
                "additionalProperties": False,
            },
            "outputSchema": _STEERING_OUTPUT,
        }

    def payload(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return {key: arguments[key] for key in self.extra if key in arguments}


STEERING_TOOLS = {
    t.name: t
    for t in (
        SteeringTool("pause_task", "pause", "Pause a task at its next safe point (steering).", {}),
        SteeringTool("resume_task", "resume", "Resume a paused task (steering).", {}),
        SteeringTool("cancel_task", "cancel", "Cancel a task with a reason, at its next safe point (steering).", {}),
        SteeringTool(
            "adjust_goal",
            "adjust_goal",
            "Re-aim a task: a new goal and/or constraints (steering).",
            {"goal": {"type": "string", "maxLength": 10_000}, "constraints": {"type": "object"}},
        ),
        SteeringTool(
            "set_priority",
            "set_priority",
            "Change a task's priority, 0 (first) to 9 (steering).",
            {"priority": {"type": "integer", "minimum": 0, "maximum": 9}},
            ("priority",),
        ),
        SteeringTool(
            "kill_task",
            "kill",
            "Emergency stop: abort a task's running step now, without waiting for it; "
            "a reason is required. Tool calls in flight are cut or finish first as the Kill Policy says "
            "(steering).",
            {},
            ("reason",),
        ),
    )
}


def task_support(agent: agents.Agent) -> str:
    return agent.mcp.task_support


def agent_tool(agent: agents.Agent, *, legacy: bool) -> dict[str, Any]:
    tool = {
        "name": agent.name,
        "description": agent.description or agent.name,
        "inputSchema": {"type": "object", **agent.input_schema},
        "outputSchema": agent.output_schema,
    }
    if legacy:  # 2025-11-25 only: the 2026 Tool has no execution field
        tool["execution"] = {"taskSupport": task_support(agent)}
    return tool


def list_tools(*, legacy: bool) -> list[dict[str, Any]]:
    """Deterministic order: synchronous tools first (generic clients try the first tool
    without the tasks extension), then task-optional, then task-required, each by name;
    the steering tools last."""
    rank = {FORBIDDEN: 0, OPTIONAL: 1, REQUIRED: 2}
    found = sorted(
        (agents.get_agent(name) for name in agents.agent_names()),
        key=lambda agent: (rank.get(task_support(agent), 2), agent.name),
    )
    tools = [agent_tool(agent, legacy=legacy) for agent in found]
    for steering in STEERING_TOOLS.values():
        tool = steering.definition()
        if legacy:
            tool["execution"] = {"taskSupport": FORBIDDEN}
        tools.append(tool)
    return tools


def call_tool_result(agent_name: str, result: dict[str, Any] | None) -> dict[str, Any]:
    """A completed run's CallToolResult (without resultType): the agent's own content
    when its mcp_tool_result gives one, else its result as JSON text; always structured."""
    result = result or {}
    agent = agents.get_agent(agent_name)
    fields = agent.mcp_tool_result(result)
    if fields is None:
        fields = {"content": [{"type": "text", "text": json.dumps(result, separators=(",", ":"))}], "isError": False}
    return {**fields, "structuredContent": result}


def error_result(message: str, **structured: Any) -> dict[str, Any]:
    """A tool-level error (isError), not a JSON-RPC error: the model sees why."""
    answer: dict[str, Any] = {"content": [{"type": "text", "text": message}], "isError": True}
    if structured:
        answer["structuredContent"] = structured
    return answer
