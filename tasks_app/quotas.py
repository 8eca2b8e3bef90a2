"""Per-tenant daily quotas (config/runtime.yaml `limits`): tool calls and cost per UTC day.

Counted in PostgreSQL, in TenantDailyUsage, inside the transaction that makes the use
durable: a tool call is taken with its ledger row (a replayed or reconciled call has its
row already and is not counted again; a call whose row never committed is not counted), a
step's cost with the step's commit. The row is locked while a call is taken, so two
workers can never both take a tenant's last call: the cap holds exactly.

Cost is known only after the fact, so the cost quota is checked before each tool call and
at each safe point: the step that crosses it finishes, the next call or step waits or fails.
"""

from __future__ import annotations

from datetime import UTC, date, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from tasks_app.models import TenantDailyUsage

FAIL, WAIT = "fail", "wait"


class QuotaReached(Exception):
    """The tenant used up a daily quota; `reason` says which and when it resets."""


def _limits() -> tuple[int, float]:
    limits = settings.RUNTIME.get("limits", {})
    return int(limits.get("tool_calls_per_tenant_day", 0) or 0), float(limits.get("cost_per_tenant_day", 0) or 0)


def on_quota() -> str:
    return str(settings.RUNTIME.get("limits", {}).get("on_quota", FAIL))


def today() -> date:
    return timezone.now().astimezone(UTC).date()


def _resets() -> str:
    return f"resets at {today() + timedelta(days=1):%Y-%m-%d} 00:00 UTC"


def _reason(what: str, used: float, cap: float, key: str) -> str:
    return f"tenant quota reached: {what} {used:g} of {cap:g} today (limits.{key}); {_resets()}"


def _check(usage: TenantDailyUsage | None, *, calling: bool) -> None:
    calls_cap, cost_cap = _limits()
    calls, cost = (usage.tool_calls, usage.cost) if usage is not None else (0, 0.0)
    if calling and calls_cap and calls >= calls_cap:
        raise QuotaReached(_reason("tool calls", calls, calls_cap, "tool_calls_per_tenant_day"))
    if cost_cap and cost >= cost_cap:
        raise QuotaReached(_reason("cost", cost, cost_cap, "cost_per_tenant_day"))


def enabled() -> bool:
    return any(_limits())


def take_tool_call(tenant_id: int) -> None:
    """In the transaction that creates a call's ledger row: count it, or raise QuotaReached
    (and the caller's transaction, with its row, rolls back)."""
    if not enabled():
        return
    assert transaction.get_connection().in_atomic_block, "take a call in the ledger row's transaction"
    usage, _ = TenantDailyUsage.objects.select_for_update().get_or_create(tenant_id=tenant_id, day=today())
    _check(usage, calling=True)
    TenantDailyUsage.objects.filter(pk=usage.pk).update(tool_calls=F("tool_calls") + 1)


def add_cost(tenant_id: int, amount: float) -> None:
    """In the transaction that commits a step: its reported cost counts against the day."""
    if not amount or not _limits()[1]:
        return
    assert transaction.get_connection().in_atomic_block, "add cost in the step's transaction"
    usage, _ = TenantDailyUsage.objects.get_or_create(tenant_id=tenant_id, day=today())
    TenantDailyUsage.objects.filter(pk=usage.pk).update(cost=F("cost") + amount)


def cost_upsert(tenant_id: int, amount: float) -> tuple[TenantDailyUsage, str]:
    """add_cost as a row and an ON CONFLICT clause, for a write that inserts it in a
    statement of its own (tasks_app.leases.Row): today's row with `amount`, or `amount`
    added to the row already there."""
    table = connection.ops.quote_name(TenantDailyUsage._meta.db_table)
    conflict = f"ON CONFLICT (tenant_id, day) DO UPDATE SET cost = {table}.cost + EXCLUDED.cost"
    return TenantDailyUsage(tenant_id=tenant_id, day=today(), tool_calls=0, cost=amount), conflict


def cost_reached(tenant_id: int) -> str | None:
    """At a safe point: the day's cost quota used up (a read; None when not configured)."""
    if not _limits()[1]:
        return None
    try:
        _check(TenantDailyUsage.objects.filter(tenant_id=tenant_id, day=today()).first(), calling=False)
    except QuotaReached as exc:
        return str(exc)
    return None
