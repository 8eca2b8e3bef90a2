"""Who the signed-in person is, per tenant: their Membership is their role (DESIGN §3).

The dashboard builds the same Principal an API key gives (tasks_app.access.principal_for),
so the domain functions and the shared checks see a person exactly as they see an API
client; finding a person's task is tasks_app.access.task_for, as on every edge.
"""

from __future__ import annotations

from typing import cast

from django.contrib.auth.models import User
from django.http import HttpRequest

from tasks_app.models import Membership


def person(request: HttpRequest) -> User:
    """The signed-in person, for views behind login_required or an is_authenticated check."""
    return cast(User, request.user)


def memberships(user: User) -> list[Membership]:
    return list(Membership.objects.select_related("tenant").filter(user=user).order_by("tenant__slug"))
