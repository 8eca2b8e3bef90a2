from __future__ import annotations

import os
from typing import Any

from celery import Celery
from celery.signals import worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runtime_site.settings")

app = Celery("runtime_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_process_init.connect
def keep_database_connections(**_: Any) -> None:
    """Worker processes are long-lived and run one slice at a time: keep their database
    connection between slices instead of reconnecting for each (the web process, under
    ASGI, keeps CONN_MAX_AGE=0). Celery's Django fixup still drops unusable connections."""
    from django.db import connections

    for conn in connections.all(initialized_only=False):
        conn.settings_dict["CONN_MAX_AGE"] = 300
