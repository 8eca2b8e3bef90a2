"""runtime_site/config.py: the seed's steering keys state invariants, and are read as such; and
the settings read from the environment refuse what they cannot mean."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured

from runtime_site import config, dbpool


def test_the_steering_invariants_load_as_the_seed_writes_them():
    assert config.load()["steering"] == {"apply_at_safe_point": True, "optimistic_concurrency": True}


@pytest.mark.parametrize("name", ["STEERING_APPLY_AT_SAFE_POINT", "STEERING_OPTIMISTIC_CONCURRENCY"])
def test_a_deployment_cannot_switch_an_invariant_off(monkeypatch, name):
    monkeypatch.setenv(name, "false")
    with pytest.raises(ImproperlyConfigured, match="must be true"):
        config.load()


@pytest.mark.parametrize("value", ["OFF", "none", "false", "-1", "5.5"])
def test_a_prepare_threshold_that_is_no_count_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("RUNTIME_DB_PREPARE_THRESHOLD", value)
    with pytest.raises(ImproperlyConfigured, match="RUNTIME_DB_PREPARE_THRESHOLD"):
        dbpool.prepare_threshold()


@pytest.mark.parametrize(("value", "threshold"), [("off", None), ("", None), ("0", 0), ("5", 5)])
def test_a_prepare_threshold_is_a_count_or_off(monkeypatch, value, threshold):
    monkeypatch.setenv("RUNTIME_DB_PREPARE_THRESHOLD", value)
    assert dbpool.prepare_threshold() == threshold


@pytest.mark.parametrize("value", ["ten", "nan", "inf", "-1", "1e999"])
def test_a_query_deadline_that_is_no_number_of_seconds_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("RUNTIME_DB_QUERY_SECONDS", value)
    with pytest.raises(ImproperlyConfigured, match="RUNTIME_DB_QUERY_SECONDS"):
        dbpool.query_seconds()


def _worker_query_seconds(value: str | None) -> subprocess.CompletedProcess[str]:
    """What a process reading RUNTIME_DB_WORKER_QUERY_SECONDS=value at import makes of it."""
    env = {k: v for k, v in os.environ.items() if k != "RUNTIME_DB_WORKER_QUERY_SECONDS"}
    if value is not None:
        env["RUNTIME_DB_WORKER_QUERY_SECONDS"] = value
    code = "from runtime_site import dbpool; print(dbpool.WORKER_QUERY_SECONDS)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)


@pytest.mark.parametrize(("value", "seconds"), [(None, "60.0"), ("2.5", "2.5"), ("off", "None")])
def test_a_workers_query_deadline_comes_from_the_environment(value, seconds):
    read = _worker_query_seconds(value)
    assert read.returncode == 0, read.stderr
    assert read.stdout.strip() == seconds


@pytest.mark.parametrize("value", ["ten", "nan", "-1"])
def test_a_workers_query_deadline_that_is_no_number_of_seconds_is_refused_by_name(value):
    read = _worker_query_seconds(value)
    assert read.returncode != 0
    assert f"RUNTIME_DB_WORKER_QUERY_SECONDS={value!r}: use seconds above 0" in read.stderr


@pytest.mark.parametrize("value", ["ten", "nan", "inf", "-1", "0", "1e999"])
def test_an_idle_in_transaction_bound_that_is_no_number_of_seconds_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("RUNTIME_DB_IDLE_IN_TRANSACTION_SECONDS", value)
    with pytest.raises(ImproperlyConfigured, match="RUNTIME_DB_IDLE_IN_TRANSACTION_SECONDS"):
        dbpool.idle_in_transaction_ms(30)


@pytest.mark.parametrize(
    ("value", "lease", "ms"), [("", 30, 30000), ("", 3, 5000), ("2.5", 30, 2500), ("off", 30, None)]
)
def test_an_idle_in_transaction_bound_is_the_lease_at_least_5_s_unless_set(monkeypatch, value, lease, ms):
    monkeypatch.setenv("RUNTIME_DB_IDLE_IN_TRANSACTION_SECONDS", value)
    assert dbpool.idle_in_transaction_ms(lease) == ms


@pytest.mark.django_db
def test_every_process_connects_with_the_idle_in_transaction_bound():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW idle_in_transaction_session_timeout")
        assert cursor.fetchone()[0] == "30s"  # the lease (runtime.lease_seconds)
