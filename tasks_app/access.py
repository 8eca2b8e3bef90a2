"""Who sees which task and who may do what: one lookup and one role check for every edge
(REST, SSE, MCP, dashboard, admin) and every action that takes a caller.

A caller is a Principal (tasks_app.auth): an API key's, a person's in one tenant
(`principal_for`, `as_member`), or the operator console's (`console`). Actions call `check_role`
themselves, so no edge can forget a rule; edges only look the task up.

Two lookups, by what the caller means to do. Reading (`task_for`, `visible_tasks`: a
snapshot, a result, a list, a stream) needs the read scope, so every edge that shows a task
refuses a key without it the same way, MCP as REST and SSE. Acting (`task_to_act_on`:
cancel, steer, answer) only finds the task in the caller's tenant; the action then asks its
own rule (check_role: operate to steer; answer_refusal: approve to answer an approval,
operate to answer the agent's own question), so an approve-only key can answer an approval
without being able to read the task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast
from uuid import UUID

from django.conf import settings

from tasks_app.agents.questions import APPROVER_KINDS
from tasks_app.auth import Principal
from tasks_app.errors import Forbidden, TaskNotFound
from tasks_app.models import Membership, Role, Task, TaskQuerySet, Tenant

if TYPE_CHECKING:
    from django.contrib.auth.models import User
    from django.db.models import QuerySet


def check_reads(who: Principal | User) -> None:
    """Forbidden for a key (or token) without the read scope. A person reads their tenants' tasks."""
    if isinstance(who, Principal):
        check_role(who, Role.VIEWER)


def may_read(who: Principal | User) -> bool:
    """Whether `who` may read tasks (check_reads): what an answer to an act may show of the
    task. A key without the read scope acts, and is told whether the act took and the version
    to act at, never the task itself (its goal, its error, its questions)."""
    return not isinstance(who, Principal) or who.has_role(Role.VIEWER)


def visible_tasks(who: Principal | User) -> TaskQuerySet:
    """To read: a principal's tenant's tasks, or every task of a person's tenants (check_reads)."""
    check_reads(who)
    return Task.objects.visible_to(who)


def task_for(who: Principal | User, task_id: str | UUID, tasks: QuerySet[Task] | None = None) -> Task:
    """To read: the caller's task (out of `tasks`, all by default), Forbidden without the read
    scope (check_reads). Another tenant's task, a malformed id and no task at all raise the
    same TaskNotFound."""
    check_reads(who)
    return _find(who, task_id, tasks)


def task_to_act_on(who: Principal | User, task_id: str | UUID) -> Task:
    """To act on (cancel, steer, answer): the caller's task, whatever its scopes; the action
    asks its own rule. TaskNotFound as task_for."""
    return _find(who, task_id, None)


def task_uuid(task_id: str | UUID) -> UUID:
    """A task id as a UUID; a malformed one is TaskNotFound, as a missing task is."""
    try:
        return task_id if isinstance(task_id, UUID) else UUID(task_id)
    except (TypeError, ValueError):
        raise TaskNotFound from None


def _find(who: Principal | User, task_id: str | UUID, tasks: QuerySet[Task] | None) -> Task:
    uuid = task_uuid(task_id)
    base = Task.objects.all() if tasks is None else cast(TaskQuerySet, tasks)  # annotate keeps the class
    task = base.visible_to(who).select_related("tenant").filter(id=uuid).first()
    if task is None:
        raise TaskNotFound
    return task


def check_role(who: Principal, minimum: str) -> None:
    """Forbidden unless `who` has `minimum` (and, for a key, the scope its power needs)."""
    if not who.has_role(minimum):
        raise Forbidden(f"this needs the {minimum} role or above", role=minimum)


def answer_refusal(who: Principal, task: Task, kind: str) -> str | None:
    """Why `who` (a Principal) may not answer an input request of this kind, or None. One rule
    for every edge (REST's inputs, a provide_input steering command, the dashboard, MCP's
    tasks/update and legacy elicitation answers; steering_app.actions.check_may_answer looks
    the kind up): approvals need the approver role and, for a key, the approve scope (and, if
    configured, someone other than the task's creator); other questions the operator's."""
    if kind in APPROVER_KINDS:  # an approval, a budget extension
        # The approver role outranks the operator's; an approve-scoped key needs no operate scope.
        if not who.has_role(Role.APPROVER):
            return "answering an approval needs the approver role"
        if settings.RUNTIME["security"].get("approver_not_creator") and who.actor == task.created_by:
            return "the task's creator may not approve its own guarded calls"
    elif not who.has_role(Role.OPERATOR):
        return f"this needs the {Role.OPERATOR} role or above"
    return None


def principal_for(user: User, task: Task) -> Principal:
    """A signed-in person acting on one of their tenants' tasks: their membership is their role."""
    return as_member(Membership.objects.select_related("tenant").get(user=user, tenant_id=task.tenant_id))


def as_member(membership: Membership) -> Principal:
    """A signed-in person acting in one of their tenants (starting a task there, say)."""
    return Principal(tenant=membership.tenant, role=membership.role, actor=f"user:{membership.user_id}")


def console(tenant: Tenant, actor: str) -> Principal:
    """The operator console (Django admin, whose own permissions let staff in) and the
    runtime itself act in a task's tenant with every power; `actor` names who for the audit."""
    return Principal(tenant=tenant, role=Role.ADMIN, actor=actor)
