from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from tasks_app.audit import verify_chain
from tasks_app.models import Task


class Command(BaseCommand):
    help = "Verify every task's hash-chained audit records; name the first broken link of each chain."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--task", help="verify only this task id")

    def handle(self, *args: Any, **options: Any) -> None:
        tasks = Task.objects.order_by("created_at")
        if options["task"]:
            tasks = tasks.filter(id=options["task"])
        checked, broken = 0, []
        for task in tasks.iterator():
            checked += 1
            if (link := verify_chain(task)) is not None:
                broken.append(link)
                self.stderr.write(f"BROKEN {link}")
        self.stdout.write(f"{checked} chains checked, {len(broken)} broken")
        if broken:
            raise CommandError(f"{len(broken)} audit chain(s) broken; first: {broken[0]}")
