"""A do-nothing agent for benchmarks and engine tests: N steps, optionally slow."""

from __future__ import annotations

import time
from typing import Any

from tasks_app.agents.base import Agent, StepContext, register


@register
class NoopAgent(Agent):
    name = "noop"
    description = "Takes `steps` empty steps, each sleeping `sleepMs` milliseconds."
    input_schema = {
        "type": "object",
        "properties": {
            "steps": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
            "sleepMs": {"type": "number", "minimum": 0, "maximum": 600_000},
            # Before this step, ask a person whether to go on (answer false: stop early).
            "askAt": {"type": "integer", "minimum": 1},
            "costPerStep": {"type": "number", "minimum": 0},  # reported per step, against budget.maxCost
        },
        "required": ["steps"],
        "additionalProperties": False,
    }
    output_schema = {
        "type": "object",
        "properties": {"steps": {"type": "integer"}},
        "required": ["steps"],
    }

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"done": 0, "total": input["steps"], "sleepMs": input.get("sleepMs", 0), "askAt": input.get("askAt")}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return f"noop-{state['done'] + 1}" if state["done"] < state["total"] else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        if state.get("askAt") == state["done"] + 1:
            go_on = ctx.ask(
                "continue", f"Continue with step {state['askAt']} of {state['total']}?", {"type": "boolean"}
            )
            if not go_on:
                return {**state, "total": state["done"], "askAt": None}
        if state["sleepMs"]:
            time.sleep(state["sleepMs"] / 1000)
        done = state["done"] + 1
        if ctx.input.get("costPerStep"):
            ctx.report_cost(ctx.input["costPerStep"])
        ctx.progress(done / state["total"], phase="noop")
        return {**state, "done": done}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"steps": state["done"]}
