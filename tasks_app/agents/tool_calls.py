"""Make a list of tool calls, one per step, each exactly once (through the ledger).

The simplest way to drive a registered tool from a task — e.g. a tool on a remote MCP
server (`mcp.call`), whose answer may be a remote task that takes minutes.
"""

from __future__ import annotations

from typing import Any

from tasks_app.agents.base import Agent, StepContext, register


@register
class ToolCallsAgent(Agent):
    name = "tool_calls"
    description = "Runs `calls` in order, one tool call per step, each with an effect exactly once."
    input_schema = {
        "type": "object",
        "properties": {
            "calls": {
                "type": "array",
                "minItems": 1,
                "maxItems": 100,
                "items": {
                    "type": "object",
                    "properties": {"tool": {"type": "string", "minLength": 1}, "args": {"type": "object"}},
                    "required": ["tool", "args"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["calls"],
        "additionalProperties": False,
    }
    output_schema = {
        "type": "object",
        "properties": {"results": {"type": "array"}},
        "required": ["results"],
    }
    # A step is one call: up to three attempts of mcp.call's longest timeout (600 s).
    step_seconds = 3 * 600 + 60

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"results": [], "count": len(input["calls"])}

    def next_step(self, state: dict[str, Any]) -> str | None:
        done = len(state["results"])
        return f"call-{done + 1}" if done < state["count"] else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        n = len(state["results"])
        call = ctx.input["calls"][n]
        result = ctx.tool(call["tool"], call["args"])
        ctx.progress((n + 1) / state["count"], phase="calling", message=f"{call['tool']}: {n + 1} of {state['count']}")
        return {**state, "results": [*state["results"], result]}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"results": state["results"]}
