"""The baseline: a bare Celery task that enqueues its successor N times. No database."""

from __future__ import annotations

import time

import redis
from celery import shared_task
from django.conf import settings


@shared_task(name="bench.successor", ignore_result=True, acks_late=True)
def successor(run_id: str, remaining: int) -> None:
    if remaining > 0:
        successor.apply_async(args=[run_id, remaining - 1])
    else:
        redis.Redis.from_url(settings.REDIS_URL).set(f"bench:{run_id}:done", time.time(), ex=600)
