"""What a task may ask a person, typed (DESIGN §5 "ask a person").

An agent asks its own questions (ctx.ask); the runtime asks three kinds of its own: the
approval of a guarded tool call, the confirmation of an effect nobody can tell happened,
and the extension of a used-up budget. Each kind is stored on the input request
(steering_app.models.InputRequest.kind) and read back by kind, never by the key's
prefix: an agent's question keyed `budget-x` is never read as a budget extension. The
runtime's keys keep their prefixes (the wire, the CLI and the REST route
/inputs/{key} show them) and those prefixes are reserved: ctx.ask refuses them, so an
agent's question can never take a runtime question's key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.db import models


class QuestionKind(models.TextChoices):
    QUESTION = "question"  # an agent's own (ctx.ask); an agent may also raise an approval
    APPROVAL = "approval"  # a guarded tool call: "approve" or "reject"
    CONFIRMATION = "confirmation"  # did an effect of unknown outcome happen: "done" or "not_done"
    BUDGET_EXTENSION = "budget_extension"  # higher limits, or "stop"


# The kinds only an approver answers (tasks_app.access.answer_refusal).
APPROVER_KINDS = frozenset({QuestionKind.APPROVAL, QuestionKind.BUDGET_EXTENSION})

APPROVAL_PREFIX, CONFIRMATION_PREFIX, BUDGET_PREFIX = "approve-", "confirm-", "budget-"
RESERVED_PREFIXES = (APPROVAL_PREFIX, CONFIRMATION_PREFIX, BUDGET_PREFIX)


def approval_key(call_key: str) -> str:
    return APPROVAL_PREFIX + call_key


def confirmation_key(effect_key: str) -> str:
    return CONFIRMATION_PREFIX + effect_key


def budget_key(scope: str) -> str:
    """scope: `step-N` (the engine's safe point) or `call-<ledger key>` (the guard)."""
    return BUDGET_PREFIX + scope


def check_agent_key(key: str) -> None:
    """An agent's question key must not be one the runtime's questions use."""
    if key.startswith(RESERVED_PREFIXES):
        raise ValueError(f"question key {key!r}: keys starting with {', '.join(RESERVED_PREFIXES)} are the runtime's")


class Answers(dict[str, Any]):
    """A task's answered input requests: key → answer (what ctx.ask reads), and each
    answer's kind, for the runtime's typed reads."""

    def __init__(self, rows: Iterable[tuple[str, Any, str]] = ()) -> None:
        rows = list(rows)
        super().__init__((key, answer) for key, answer, _ in rows)
        self.kinds: dict[str, str] = {key: kind for key, _, kind in rows}

    @classmethod
    def of(cls, answers: Mapping[str, Any] | None) -> Answers:
        """`answers` as Answers; a plain mapping holds agents' questions only."""
        if isinstance(answers, Answers):
            return answers
        return cls((key, answer, QuestionKind.QUESTION) for key, answer in (answers or {}).items())

    def _typed(self, key: str, kind: str) -> Any:
        return self[key] if self.kinds.get(key) == kind else None

    def answered(self, key: str, kind: str) -> bool:
        return key in self and self.kinds.get(key) == kind

    def approval(self, call_key: str) -> Any:
        return self._typed(approval_key(call_key), QuestionKind.APPROVAL)

    def confirmation(self, effect_key: str) -> Any:
        return self._typed(confirmation_key(effect_key), QuestionKind.CONFIRMATION)

    def budget_extensions(self) -> list[Any]:
        return [answer for key, answer in self.items() if self.kinds.get(key) == QuestionKind.BUDGET_EXTENSION]
