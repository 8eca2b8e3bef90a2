"""Typed questions (tasks_app/agents/questions.py): the runtime reads its approvals,
confirmations and budget extensions by kind, never an agent's question by its key (in-process)."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps as django_apps

from runtime_site.blobstore import blob_store
from steering_app.actions import answer_refusal, answers_for
from steering_app.models import InputRequest
from tasks_app import policy
from tasks_app.agents.base import InputNeeded, StepContext
from tasks_app.agents.questions import Answers, QuestionKind
from tasks_app.auth import Principal
from tasks_app.tests.test_engine import new_task


def test_an_agents_question_keyed_like_a_budget_extension_is_not_one():
    raised = {"maxSteps": 10_000}
    asked_by_agent = Answers([("budget-x", raised, QuestionKind.QUESTION)])
    granted = Answers([("budget-step-3", raised, QuestionKind.BUDGET_EXTENSION)])
    assert policy.effective_budget({"maxSteps": 5}, asked_by_agent)["maxSteps"] == 5
    assert policy.effective_budget({"maxSteps": 5}, granted)["maxSteps"] == 10_000
    assert policy.effective_budget({"maxSteps": 5}, {"budget-step-3": raised})["maxSteps"] == 5  # untyped: an agent's


def test_an_approval_and_a_confirmation_count_only_with_their_kind():
    answers = Answers(
        [
            ("approve-t:1:1", "approve", QuestionKind.QUESTION),  # an operator's answer to an agent's question
            ("approve-t:2:1", "approve", QuestionKind.APPROVAL),
            ("confirm-t:3:1", "done", QuestionKind.QUESTION),
            ("confirm-t:4:1", "done", QuestionKind.CONFIRMATION),
        ]
    )
    assert answers.approval("t:1:1") is None and answers.approval("t:2:1") == "approve"
    assert answers.confirmation("t:3:1") is None and answers.confirmation("t:4:1") == "done"
    assert answers["approve-t:1:1"] == "approve"  # what ctx.ask reads, by key, is unchanged


@pytest.mark.parametrize("key", ["approve-publish", "confirm-x", "budget-x"])
def test_an_agent_cannot_ask_with_a_key_the_runtime_reserves(key):
    ctx = StepContext(task_id="t", goal="", input={}, step_name="s", sequence=1, blobs=blob_store())
    with pytest.raises(ValueError, match="the runtime's"):
        ctx.ask(key, "?", {"type": "string"})
    with pytest.raises(ValueError, match="the runtime's"):
        ctx.ask_all({"fine": ("?", {}), key: ("?", {})})
    with pytest.raises(InputNeeded):  # a key without the dash is the agent's to use
        ctx.ask("confirm", "?", {"type": "string"})


def test_a_budget_extension_needs_the_approver_role_like_an_approval(db, alice):
    task = new_task(alice)
    operator = Principal(tenant=alice.tenant, role="operator", actor="user:op")
    approver = Principal(tenant=alice.tenant, role="approver", actor="user:ap")
    for kind in (QuestionKind.APPROVAL, QuestionKind.BUDGET_EXTENSION):
        assert "approver role" in answer_refusal(operator, task, kind)
        assert answer_refusal(approver, task, kind) is None
    for kind in (QuestionKind.QUESTION, QuestionKind.CONFIRMATION):
        assert answer_refusal(operator, task, kind) is None


def test_answers_for_carries_each_answers_kind_and_old_rows_are_retyped(db, alice):
    task = new_task(alice)
    rows = {
        "confirm-t:1:1": "question",  # a confirmation asked before kinds were typed
        "budget-step-2": "approval",  # a budget extension asked before kinds were typed
        "budget-x": "question",  # an agent's own question: stays one
        "approve-t:3:1": "approval",
    }
    for key, kind in rows.items():
        InputRequest.objects.create(
            tenant=alice.tenant, task=task, key=key, kind=kind, prompt="?", step_sequence=1, status="answered", answer=1
        )
    migration = importlib.import_module("steering_app.migrations.0004_question_kinds")
    migration.type_existing(django_apps, None)
    kinds = answers_for(task).kinds
    assert kinds == {
        "confirm-t:1:1": "confirmation",
        "budget-step-2": "budget_extension",
        "budget-x": "question",
        "approve-t:3:1": "approval",
    }
