from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from tasks_app.auth import issue_api_key
from tasks_app.models import Membership, Role, Tenant


class Command(BaseCommand):
    help = "Create (or reuse) a demo tenant and user, issue a fresh admin API key and print it."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--tenant", default="demo")
        parser.add_argument("--username", default="demo")
        parser.add_argument("--password", default="demo", help="for the admin and dashboard login")
        parser.add_argument("--role", default=Role.ADMIN, choices=Role.values)
        parser.add_argument("--key-only", action="store_true", help="print only the API key")

    def handle(self, *args: Any, **options: Any) -> None:
        tenant, _ = Tenant.objects.get_or_create(slug=options["tenant"], defaults={"name": options["tenant"].title()})
        user, created = get_user_model().objects.get_or_create(username=options["username"])
        if created:
            user.set_password(options["password"])
            user.is_staff = user.is_superuser = options["role"] == Role.ADMIN
            user.save()
        Membership.objects.update_or_create(tenant=tenant, user=user, defaults={"role": options["role"]})
        _, token = issue_api_key(tenant, user, role=options["role"], name=f"{options['username']} key")
        if options["key_only"]:
            self.stdout.write(token)
        else:
            self.stdout.write(f"tenant={tenant.slug} user={user.username} role={options['role']}\nAPI key: {token}")
