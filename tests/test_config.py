"""runtime_site/config.py: the seed's steering keys state invariants, and are read as such; and
the settings read from the environment refuse what they cannot mean."""

from __future__ import annotations

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
