"""Tool.side_effect: a call that changes nothing outside (llm.chat) cut by a kill or lost with
a worker is sent again; it is never marked unknown for a reconcile or a person (in-process)."""

from __future__ import annotations

import pytest

from ledger_app.actions import _reconciled, settle_interrupted
from ledger_app.models import LedgerEntry
from steering_app.actions import do_enqueue_command
from tasks_app import leases
from tasks_app.access import console
from tasks_app.agents import tools
from tasks_app.models import Task
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db


def started(task: Task, tool: str, index: int, epoch: int = 1) -> LedgerEntry:
    return LedgerEntry.objects.create(
        tenant=task.tenant, task=task, step_sequence=1, call_index=index, key=f"{task.id}:1:{index}", tool=tool,
        fingerprint="f", status="started", lease_epoch=epoch,
    )  # fmt: skip


def test_a_lost_worker_leaves_its_model_call_to_be_sent_again_and_its_http_call_unknown(alice):
    assert tools.get_tool("llm.chat").side_effect is False and tools.get_tool("http.request").side_effect
    task = new_task(alice)
    model, http = started(task, "llm.chat", 1), started(task, "http.request", 2)
    assert settle_interrupted(task.id, before_epoch=2) == 1  # the rows of epoch 1, by a worker of epoch 2
    assert LedgerEntry.objects.get(id=model.id).status == "started"
    assert LedgerEntry.objects.get(id=http.id).status == "unknown"


def test_a_kill_cuts_a_model_call_without_leaving_anything_to_reconcile(alice, settings):
    settings.RUNTIME = {**settings.RUNTIME, "kill": {**settings.RUNTIME["kill"], "cut": ["llm.chat", "http.request"]}}
    task = new_task(alice)
    lease = leases.claim(task.id, worker_id="w1", ttl=60)
    assert lease is not None
    model, http = started(task, "llm.chat", 1, lease.epoch), started(task, "http.request", 2, lease.epoch)
    command, _ = do_enqueue_command(
        task.id, who=console(alice.tenant, "user:op"), command_id="k", type="kill", payload={},
        expected_version=Task.objects.get(id=task.id).state_version, reason="runaway",
    )  # fmt: skip
    assert command.status == "applied" and Task.objects.get(id=task.id).status == "cancelled"
    assert LedgerEntry.objects.get(id=model.id).status == "started"  # nothing to reconcile: sent again on a redrive
    assert LedgerEntry.objects.get(id=http.id).status == "unknown"


def test_a_call_without_side_effects_is_never_reconciled_or_put_to_a_person(alice):
    task = new_task(alice)
    lease = leases.claim(task.id, worker_id="w1", ttl=60)
    asked = []

    def reconcile(args, key):
        asked.append(key)
        # "cannot tell": with side effects, a person would be asked

    harmless = tools.Tool("test.pure", {}, call=lambda args, key, timeout: {}, side_effect=False, reconcile=reconcile)
    entry = started(task, "test.pure", 1)
    assert _reconciled(lease, entry, harmless, {}, {}) is False  # not done: the caller sends it again
    assert asked == [] and LedgerEntry.objects.get(id=entry.id).status == "started"
