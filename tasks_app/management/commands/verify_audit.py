from __future__ import annotations

import argparse
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from tasks_app.audit import verify_anchors, verify_chain
from tasks_app.models import Task


def _grace(text: str) -> timedelta:
    """--anchor-grace: seconds, at least 0 and at most a year (NaN, inf or 1e20 are not a wait)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= seconds <= 366 * 86400:  # also false for NaN
        raise argparse.ArgumentTypeError(f"{text!r}: between 0 and 31622400 seconds (a year)")
    return timedelta(seconds=seconds)


class Command(BaseCommand):
    help = (
        "Verify every task's hash-chained audit records and hold them against the signed anchors in "
        "the blob store; name the first broken link of each chain and every anchored record that changed."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--task", help="verify only this task id")
        parser.add_argument(
            "--since",
            type=datetime.fromisoformat,
            help="skip anchors taken and records written before this ISO time (tasks deleted by retention policy)",
        )
        parser.add_argument(
            "--anchor-grace",
            type=_grace,
            help="seconds a record may wait for its first anchor before it is a gap "
            "(default: five audit.anchor_seconds, at least 300)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        tasks = Task.objects.order_by("created_at")
        if options["task"]:
            tasks = tasks.filter(id=options["task"])
        checked, broken = 0, []
        for task in tasks.iterator():
            checked += 1
            if (link := verify_chain(task)) is not None:
                broken.append(link)
        anchors, anchor_problems = verify_anchors(
            task_id=options["task"], since=options["since"], grace=options["anchor_grace"]
        )
        broken.extend(anchor_problems)
        for link in broken:
            self.stderr.write(f"BROKEN {link}")
        if not settings.RUNTIME_AUDIT_KEY:
            self.stderr.write(
                "warning: RUNTIME_AUDIT_KEY is not set: no anchors are written, and a rewrite "
                "with recomputed hashes cannot be told from the real chain"
            )
        self.stdout.write(f"{checked} chains checked, {anchors} anchors checked, {len(broken)} broken")
        if broken:
            raise CommandError(f"{len(broken)} audit problem(s); first: {broken[0]}")
