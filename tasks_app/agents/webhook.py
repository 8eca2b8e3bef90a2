"""Notify a webhook: one HTTP POST per step through the ledger, so each happens once."""

from __future__ import annotations

import time
from typing import Any

from tasks_app.agents.base import Agent, StepContext, register


@register
class WebhookAgent(Agent):
    name = "webhook"
    description = "POSTs `payload` to `url` `count` times (with n = 1..count), each exactly once."
    input_schema = {
        "type": "object",
        "properties": {
            "url": {"type": "string", "pattern": "^https?://"},
            "payload": {"type": "object"},
            "count": {"type": "integer", "minimum": 1, "maximum": 1000},
            "reconcileUrl": {"type": "string", "pattern": "^https?://"},
            "tool": {"type": "string"},  # another registered tool with the same arguments
            "sleepMs": {"type": "integer", "minimum": 0, "maximum": 60_000},
        },
        "required": ["url"],
        "additionalProperties": False,
    }
    output_schema = {
        "type": "object",
        "properties": {"sent": {"type": "integer"}, "statuses": {"type": "array", "items": {"type": "integer"}}},
        "required": ["sent", "statuses"],
    }

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"sent": 0, "count": input.get("count", 1), "statuses": []}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return f"notify-{state['sent'] + 1}" if state["sent"] < state["count"] else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        n = state["sent"] + 1
        args = {"url": ctx.input["url"], "json": {**ctx.input.get("payload", {}), "n": n}}
        if ctx.input.get("reconcileUrl"):
            args["reconcileUrl"] = ctx.input["reconcileUrl"]
        if ctx.input.get("sleepMs"):
            time.sleep(ctx.input["sleepMs"] / 1000)
        response = ctx.tool(ctx.input.get("tool", "http.request"), args)
        ctx.progress(n / state["count"], phase="notifying", message=f"sent {n} of {state['count']}")
        return {**state, "sent": n, "statuses": [*state["statuses"], (response or {}).get("status", 0)]}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"sent": state["sent"], "statuses": state["statuses"]}
