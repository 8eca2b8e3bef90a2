"""Per-tenant daily quotas (issue 16): tool calls and cost per UTC day, counted with the
ledger row and the step commit (tasks_app/quotas.py). A real worker calls a real local
HTTP remote (tests/sink.py), which counts what actually went out."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any, ClassVar

import pytest

from conftest import FAST_LEASES, settled, wait_until
from tasks_app import engine, quotas
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents import base as agents
from tasks_app.models import Step, Task, TenantDailyUsage
from tests.test_kill_running import calls
from tests.test_ledger import Sink

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_LEASES, "SECURITY_HTTP_ALLOWLIST": "127.0.0.1", "TOOLS_REMOTE_POLL_SECONDS": "0.5"}


def usage(tenant) -> TenantDailyUsage:
    return TenantDailyUsage.objects.get(tenant=tenant, day=quotas.today())


def test_a_task_past_the_tenants_daily_tool_calls_fails_saying_so(alice, mallory, processes):
    sink = Sink(processes)
    processes.worker(**FAST, LIMITS_TOOL_CALLS_PER_TENANT_DAY="3")
    first = calls(alice, *[f"{sink.url}/effects"] * 2)
    assert settled(first).status == "completed"
    second = settled(calls(alice, *[f"{sink.url}/effects"] * 3))
    assert second.status == "failed" and second.error["code"] == "quota_exceeded", second.error
    assert "tool calls 3 of 3 today (limits.tool_calls_per_tenant_day)" in second.error["message"]
    assert "resets at" in second.error["message"]
    assert sink.stats()["posts"] == 3 and usage(alice.tenant).tool_calls == 3  # exactly the cap went out
    # another tenant has its own day
    other = settled(calls(mallory, f"{sink.url}/effects"))
    assert other.status == "completed" and usage(mallory.tenant).tool_calls == 1


def test_with_on_quota_wait_a_task_waits_for_the_next_day(alice, processes):
    sink = Sink(processes)
    processes.worker(**FAST, LIMITS_TOOL_CALLS_PER_TENANT_DAY="1", LIMITS_ON_QUOTA="wait")
    task = calls(alice, f"{sink.url}/effects", f"{sink.url}/effects")
    waiting = wait_until(
        lambda: "tenant quota reached" in (Task.objects.get(id=task.id).status_message or ""),
        timeout=60,
        what="the task to wait on the quota",
    )
    assert waiting
    assert Task.objects.get(id=task.id).status == "working" and sink.stats()["posts"] == 1
    # The day turns (the row of today becomes yesterday's): the task goes on by itself.
    TenantDailyUsage.objects.filter(tenant=alice.tenant).update(day=quotas.today() - timedelta(days=1))
    assert settled(task).status == "completed"
    assert sink.stats()["posts"] == 2 and usage(alice.tenant).tool_calls == 1


def test_the_cost_quota_stops_the_next_step_and_counts_each_step_once(alice, settings):
    settings.RUNTIME = {**settings.RUNTIME, "limits": {**settings.RUNTIME["limits"], "cost_per_tenant_day": 2.5}}
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 10, "costPerStep": 1})
    while engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE:
        pass
    task.refresh_from_db()
    # steps 1-3 ran (the third crossed 2.5); the safe point before the fourth stopped it
    assert task.status == "failed" and task.error["code"] == "quota_exceeded"
    assert "cost 3 of 2.5 today (limits.cost_per_tenant_day)" in task.error["message"]
    assert task.steps_done == 3 and usage(alice.tenant).cost == 3.0


def test_a_step_run_again_after_a_worker_is_killed_counts_its_cost_once(alice, processes):
    """Steps committed after the last checkpoint run again when a worker dies; what they
    report was counted when they first committed, on the task (its maxCost) and the day."""
    env = {**FAST, "RUNTIME_SLICE_STEPS": "1000", "RUNTIME_SLICE_SECONDS": "600", "LIMITS_COST_PER_TENANT_DAY": "1000"}
    processes.beat(**env)
    worker = processes.worker(**env)
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="noop",
        input={"steps": 16, "sleepMs": 300, "costPerStep": 1},
        checkpoint_policy={"everySteps": 10},
    )
    wait_until(lambda: Task.objects.get(id=task.id).steps_done >= 13, timeout=60, what="steps past the checkpoint")
    processes.kill(worker)  # SIGKILL: steps 11..13 committed after checkpoint 10 run again
    processes.worker(**env)
    assert settled(task, timeout=120).status == "completed"
    assert Step.objects.filter(task=task, sequence=11, attempt=2).exists()  # a real re-run
    task.refresh_from_db()
    assert task.cost == 16.0 and usage(alice.tenant).cost == 16.0


class CostReporter(agents.Agent):
    """Reports what its input says a step cost, as a plugin passing on a provider's figure."""

    name = "cost_reporter"
    input_schema: ClassVar[dict[str, Any]] = {"type": "object", "properties": {"cost": {"type": "string"}}}

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"done": False}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return None if state["done"] else "spend"

    def run_step(self, ctx: agents.StepContext, state: dict[str, Any]) -> dict[str, Any]:
        ctx.report_cost(float(ctx.input["cost"]))
        return {"done": True}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {}


@pytest.fixture
def cost_reporter() -> Iterator[None]:
    agents._REGISTRY[CostReporter.name] = CostReporter
    yield
    del agents._REGISTRY[CostReporter.name]


def run(task: Task) -> Task:
    while engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE:
        pass
    return Task.objects.get(id=task.id)


def test_a_cost_that_is_not_a_finite_number_fails_its_step_and_never_reaches_the_day(alice, settings, cost_reporter):
    """NaN compares false with every cap (a day at NaN is never over it) and infinity is over
    every cap: either, added to the tenant's day, would switch the quota off or on for the
    whole tenant until midnight."""
    settings.RUNTIME = {**settings.RUNTIME, "limits": {**settings.RUNTIME["limits"], "cost_per_tenant_day": 2.5}}
    for bad in ("nan", "inf", "-inf"):
        task, _ = do_create_task(console(alice.tenant, "user:test"), agent="cost_reporter", input={"cost": bad})
        task = run(task)
        assert task.status == "failed" and "finite" in task.error["message"], (bad, task.error)
        assert task.cost == 0.0
    assert not TenantDailyUsage.objects.filter(tenant=alice.tenant, cost__gt=0).exists()
    # the day's quota still holds, at the same step as in the test above
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 10, "costPerStep": 1})
    task = run(task)
    assert task.status == "failed" and task.error["code"] == "quota_exceeded" and task.steps_done == 3
