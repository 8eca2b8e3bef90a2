"""The baselines: bare Celery tasks that enqueue their successor N times."""

from __future__ import annotations

import time

import redis
from celery import shared_task
from django.conf import settings
from django.db import connection, transaction


@shared_task(name="bench.successor", ignore_result=True, acks_late=True)
def successor(run_id: str, remaining: int) -> None:
    """No database."""
    if remaining > 0:
        successor.apply_async(args=[run_id, remaining - 1])
    else:
        redis.Redis.from_url(settings.REDIS_URL).set(f"bench:{run_id}:done", time.time(), ex=600)


@shared_task(name="bench.successor_pg", ignore_result=True, acks_late=True)
def successor_pg(run_id: str, remaining: int) -> None:
    """One PostgreSQL transaction per hop (update a row, insert a row, commit: the least a
    durable slice writes), then the successor, as the engine hands on after its last commit.
    The table is bench/slices.py's."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE bench_hop_run SET done = done + 1 WHERE id = %s RETURNING done", [run_id])
        (done,) = cursor.fetchone()
        cursor.execute("INSERT INTO bench_hop_step (run, seq) VALUES (%s, %s)", [run_id, done])
    if remaining > 0:
        successor_pg.apply_async(args=[run_id, remaining - 1])
    else:
        redis.Redis.from_url(settings.REDIS_URL).set(f"bench:{run_id}:done", time.time(), ex=600)
