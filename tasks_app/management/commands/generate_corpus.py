"""manage.py generate_corpus: write a synthetic contract corpus into the configured blob store."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from runtime_site.blobstore import blob_store
from tasks_app.agents.document_review.corpus import DEFAULT_AS_OF, generate_corpus


class Command(BaseCommand):
    help = "Generate a deterministic corpus of contract-like documents (plus manifest.json and truth.json)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--prefix", default="corpora/demo", help="blob key prefix (default corpora/demo)")
        parser.add_argument("--count", type=int, default=2000, help="number of documents (default 2000)")
        parser.add_argument("--seed", type=int, default=42, help="random seed (default 42)")
        parser.add_argument(
            "--as-of",
            default=DEFAULT_AS_OF,
            help=f"date documents are judged expired against (default {DEFAULT_AS_OF})",
        )
        parser.add_argument(
            "--if-missing",
            action="store_true",
            help="do nothing when a complete corpus (its manifest) already exists at --prefix",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        prefix = options["prefix"].strip("/")
        count = options["count"]
        if not prefix:
            raise CommandError("--prefix must not be empty")
        if count < 1:
            raise CommandError("--count must be at least 1")
        try:
            dt.date.fromisoformat(options["as_of"])
        except ValueError:
            raise CommandError(f"--as-of {options['as_of']!r} is not an ISO date (YYYY-MM-DD)") from None
        if options["if_missing"] and blob_store().exists(f"{prefix}/manifest.json"):
            self.stdout.write(f"prefix={prefix}: corpus already present")
            return
        started = time.perf_counter()
        manifest = generate_corpus(blob_store(), prefix, count, options["seed"], options["as_of"])
        elapsed = time.perf_counter() - started
        self.stdout.write(
            f"prefix={prefix} count={manifest['count']} seed={manifest['seed']} "
            f"asOf={manifest['asOf']} ({elapsed:.2f}s)"
        )
