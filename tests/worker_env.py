"""Loaded with `-p tests.worker_env` (bin/test), before pytest-django imports the settings.

Under pytest-xdist each test worker is its own deployment: its own Redis namespace (queues,
channels, locks) and data directory, inherited by the worker, web and beat processes its
tests start. Without this, two test workers' Celery workers would take each other's slices.
pytest-xdist sets PYTEST_XDIST_WORKER before the worker's configuration is built.
"""

import os
from pathlib import Path

if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["RUNTIME_DEPLOYMENT"] = f"{os.environ.get('RUNTIME_DEPLOYMENT', 'rt')}-{worker}"
    if data_dir := os.environ.get("RUNTIME_DATA_DIR"):
        os.environ["RUNTIME_DATA_DIR"] = str(Path(data_dir) / worker)
        Path(os.environ["RUNTIME_DATA_DIR"]).mkdir(parents=True, exist_ok=True)
