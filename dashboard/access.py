"""Who the signed-in person is, per tenant: their Membership is their role (DESIGN §3).

The dashboard builds the same Principal an API key gives, so the domain functions and the
shared checks see a person exactly as they see an API client.
"""

from __future__ import annotations

from typing import cast
from uuid import UUID

from django.contrib.auth.models import User
from django.http import Http404, HttpRequest

from tasks_app.auth import Principal
from tasks_app.models import Membership, Task, TaskQuerySet


def person(request: HttpRequest) -> User:
    """The signed-in person, for views behind login_required or an is_authenticated check."""
    return cast(User, request.user)


def visible_tasks(user: User) -> TaskQuerySet:
    return Task.objects.filter(tenant__memberships__user=user)


def task_for(user: User, task_id: UUID) -> Task:
    """The person's tenant's task; another tenant's task is the same 404 as no task."""
    task = visible_tasks(user).select_related("tenant").filter(id=task_id).first()
    if task is None:
        raise Http404("no such task")
    return task


def principal_for(user: User, task: Task) -> Principal:
    membership = Membership.objects.select_related("tenant").get(user=user, tenant_id=task.tenant_id)
    return Principal(tenant=membership.tenant, role=membership.role, actor=f"user:{user.pk}")


def memberships(user: User) -> list[Membership]:
    return list(Membership.objects.select_related("tenant").filter(user=user).order_by("tenant__slug"))
