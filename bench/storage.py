"""Storage per task: bytes in the database by steps, with retention applied, and bytes per
step of the document review.

    .venv/bin/python bench/storage.py --steps 100 1000 4000 --docs 100 400

In process, no broker hop: each task runs slice after slice (engine.run_slice, default
slices and checkpoint policy) until it ends, then the beat's retention runs as it would
once the task has ended (checkpoint.keep newest checkpoints per task; events of tasks
that ended longer ago than stream.retention_seconds: run with 0 so they go now, and also
reported before). Measured per task with pg_column_size over each table's rows of the
task (row data, not indexes or page overhead): steps, checkpoints, events, audit records,
ledger entries; total bytes and bytes per step. `noop` tasks of N steps (a state that
does not grow), and `document_review` of K documents (--batch per step) (a state that grows with the
documents reviewed: findings). Growth is linear if bytes/step stays flat as N grows.
"""

from __future__ import annotations

import argparse

import _common

TABLES = {
    "steps": "tasks_app_step",
    "checkpoints": "checkpoints_app_checkpoint",
    "events": "tasks_app_taskevent",
    "audit": "tasks_app_auditrecord",
    "ledger": "ledger_app_ledgerentry",
}


def sizes(task_id: object) -> dict[str, int]:
    from django.db import connection

    out = {}
    with connection.cursor() as cursor:
        for name, table in TABLES.items():
            # Table names are the constants above, not input.
            cursor.execute(f"SELECT coalesce(sum(pg_column_size(t.*)), 0) FROM {table} t WHERE task_id = %s", [task_id])  # noqa: S608
            out[name] = int(cursor.fetchone()[0])
    return out


def run(tenant: object, agent: str, input: dict) -> tuple[object, int, dict[str, int], dict[str, int]]:
    from tasks_app import engine, retention
    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.models import Task

    task, _ = do_create_task(console(tenant, "user:bench"), agent=agent, input=input)
    while engine.run_slice(task.id, worker_id="bench") is engine.SliceOutcome.CONTINUE:
        pass
    task = Task.objects.get(id=task.id)
    assert task.status == "completed", (task.status, task.error)
    before = sizes(task.id)
    retention.trim_checkpoints()
    retention.trim_events(retention_seconds=0)
    return task.id, task.steps_done, before, sizes(task.id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 1000, 4000])
    parser.add_argument("--docs", type=int, nargs="+", default=[100, 400])
    parser.add_argument("--batch", type=int, default=2, help="documents per document_review step")
    args = parser.parse_args()
    _common.setup(REDIS_URL="")  # no broker: the slices run here, nothing needs a message
    from django.conf import settings

    from runtime_site.blobstore import blob_store
    from tasks_app.agents.document_review.corpus import generate_corpus
    from tasks_app.models import Tenant

    tenant = Tenant.objects.create(slug="bench", name="bench")
    rows = []
    for n in args.steps:
        rows.append((f"noop {n} steps", *run(tenant, "noop", {"steps": n})[1:]))
    for docs in args.docs:
        generate_corpus(blob_store(), f"corpora/bench-{docs}", docs, 42, "2026-11-01")
        rows.append(
            (
                f"document_review {docs} docs",
                *run(tenant, "document_review", {"corpus": f"corpora/bench-{docs}", "batchSize": args.batch})[1:],
            )
        )
    keep = settings.RUNTIME["checkpoint"]["keep"]
    print(f"bytes of row data per task (pg_column_size); retention: newest {keep} checkpoints, events of ended tasks")
    print(
        f"{'task':28} {'steps':>6} {'before':>10} {'after':>10} {'B/step':>7} " + " ".join(f"{k:>11}" for k in TABLES)
    )
    for label, steps, before, after in rows:
        total_before, total_after = sum(before.values()), sum(after.values())
        print(
            f"{label:28} {steps:6} {total_before:10} {total_after:10} {total_after / steps:7.0f} "
            + " ".join(f"{after[k]:11}" for k in TABLES)
        )
    print("after: per table, once retention ran; B/step: after / steps (flat as steps grow: linear growth)")


if __name__ == "__main__":
    main()
