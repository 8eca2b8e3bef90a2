"""The policy guard: decides before each tool call and writes nothing (DESIGN §6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

ALLOW, DENY, NEEDS_APPROVAL = "allow", "deny", "needs_approval"


@dataclass(frozen=True)
class Decision:
    verdict: str
    reason: str = ""


@dataclass(frozen=True)
class Usage:
    """What the task has used so far (read by the caller; the guard only compares)."""

    steps: int
    tool_calls: int
    wall_seconds: float
    cost: float = 0.0


def denial(tool: str) -> str | None:
    """Why a tool is never allowed (registered or not), or None."""
    if tool in settings.RUNTIME["security"]["deny_tools"]:
        return f"tool {tool!r} is denied by policy (security.deny_tools)"
    return None


def decide(tool: str, *, approval_policy: dict[str, Any], budget: dict[str, Any], usage: Usage) -> Decision:
    security = settings.RUNTIME["security"]
    if reason := denial(tool):
        return Decision(DENY, reason)
    for limit, used, what in (("maxSteps", usage.steps, "steps"), ("maxToolCalls", usage.tool_calls, "tool calls"),
                              ("maxWallSeconds", usage.wall_seconds, "seconds"), ("maxCost", usage.cost, "cost")):
        if limit in budget and used >= budget[limit]:
            return Decision(DENY, f"budget exhausted: {what} {used:g} of {budget[limit]:g} ({limit})")
    guarded = set(security["require_approval"]) | set(approval_policy.get("before", []))
    if tool in guarded:
        return Decision(NEEDS_APPROVAL, f"{tool} needs an approver's yes")
    return Decision(ALLOW)
