"""The policy guard: decides before each tool call and writes nothing (DESIGN §6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

from common.schema import SchemaError
from tasks_app.agents import tools
from tasks_app.agents.base import InputNeeded
from tasks_app.agents.questions import Answers, QuestionKind, budget_key

ALLOW, DENY, NEEDS_APPROVAL, EXHAUSTED = "allow", "deny", "needs_approval", "exhausted"


@dataclass(frozen=True)
class Decision:
    verdict: str
    reason: str = ""


@dataclass(frozen=True)
class Usage:
    """What the task has used so far (read by the caller; the guard only compares).
    None: not counted here (the engine's safe point leaves tool calls to the guard)."""

    steps: int
    tool_calls: int | None
    wall_seconds: float
    cost: float = 0.0
    tokens: int | None = None  # model tokens (ledger_app.llm.tokens_used); None: not counted


# budget key -> (Usage field, what a person reads)
LIMITS = {
    "maxSteps": ("steps", "steps"),
    "maxToolCalls": ("tool_calls", "tool calls"),
    "maxWallSeconds": ("wall_seconds", "seconds"),
    "maxCost": ("cost", "cost"),
    "maxTokens": ("tokens", "model tokens"),
}
BUDGET_SCHEMA = {
    "type": "object",
    "properties": {key: {"type": "number", "minimum": 0} for key in LIMITS},
    "additionalProperties": False,
}
APPROVAL_POLICY_SCHEMA = {
    "type": "object",
    "properties": {"before": {"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True}},
    "additionalProperties": False,
}


# What an approver answers when a budget runs out (budget.on_exhausted: ask): higher limits, or stop.
EXTENSION_SCHEMA = {"oneOf": [{"const": "stop"}, {**BUDGET_SCHEMA, "minProperties": 1}]}


def effective_budget(task_budget: dict[str, Any], answers: dict[str, Any] | None = None) -> dict[str, Any]:
    """config/runtime.yaml's `budget` defaults (0: no limit), overridden key by key by the
    task's own, then raised by the extensions approvers granted."""
    defaults = settings.RUNTIME["budget"]
    configured = {key: defaults[f"max_{field}"] for key, (field, _) in LIMITS.items() if defaults[f"max_{field}"]}
    budget = {**configured, **task_budget}
    for extension in Answers.of(answers).budget_extensions():  # by kind: never an agent's own question
        if isinstance(extension, dict):
            budget.update({limit: max(value, budget.get(limit, value)) for limit, value in extension.items()})
    return budget


def exhausted(budget: dict[str, Any], usage: Usage, answers: dict[str, Any] | None = None) -> str | None:
    """Which limit of the task's budget (with the defaults and extensions) is used up, or None."""
    budget = effective_budget(budget, answers)
    for limit, (field, what) in LIMITS.items():
        used = getattr(usage, field)
        if limit in budget and used is not None and used >= budget[limit]:
            return f"budget exhausted: {what} {used:g} of {budget[limit]:g} ({limit})"
    return None


def denial(tool: str) -> str | None:
    """Why a tool is never allowed (registered or not), or None."""
    security = settings.RUNTIME["security"]
    if tool in security["deny_tools"]:
        return f"tool {tool!r} is denied by policy (security.deny_tools)"
    if security["allow_tools"] and tool not in security["allow_tools"]:
        return f"tool {tool!r} is not in security.allow_tools"
    return None


def canonical_approval_policy(approval_policy: dict[str, Any]) -> dict[str, Any]:
    """A task's approvalPolicy with tool names checked and aliases resolved: a name the
    guard would never see (a typo) must fail at creation, not guard nothing."""
    security = settings.RUNTIME["security"]
    known = {*tools.tool_names(), *security["require_approval"], *security["deny_tools"]}
    before = []
    for given in approval_policy.get("before", []):
        name = tools.ALIASES.get(given, given)
        if name not in known:
            raise SchemaError(f"approvalPolicy before: unknown tool {name!r}; known: {', '.join(sorted(known))}")
        before.append(name)
    return {**approval_policy, "before": before} if "before" in approval_policy else approval_policy


def decide(
    tool: str,
    *,
    approval_policy: dict[str, Any],
    budget: dict[str, Any],
    usage: Usage,
    answers: dict[str, Any] | None = None,
) -> Decision:
    security = settings.RUNTIME["security"]
    if reason := denial(tool):
        return Decision(DENY, reason)
    if reason := exhausted(budget, usage, answers):
        return Decision(EXHAUSTED, reason)
    guarded = set(security["require_approval"]) | set(approval_policy.get("before", []))
    if tool in guarded:
        return Decision(NEEDS_APPROVAL, f"{tool} needs an approver's yes")
    return Decision(ALLOW)


def budget_question(scope: str, reason: str, answers: dict[str, Any]) -> InputNeeded | None:
    """With budget.on_exhausted: ask, and not asked yet: the approval that lets an approver
    raise a used-up budget (or answer "stop"). None: the task fails with `reason`."""
    key = budget_key(scope)
    if settings.RUNTIME["budget"]["on_exhausted"] != "ask" or Answers.of(answers).answered(
        key, QuestionKind.BUDGET_EXTENSION
    ):
        return None
    return InputNeeded(
        key,
        f'{reason}. Extend the budget (higher limits, e.g. {{"maxSteps": 500}}) or answer "stop".',
        EXTENSION_SCHEMA,
        kind=QuestionKind.BUDGET_EXTENSION,
    )
