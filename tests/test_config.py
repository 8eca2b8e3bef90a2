"""runtime_site/config.py: the seed's steering keys state invariants, and are read as such."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from runtime_site import config


def test_the_steering_invariants_load_as_the_seed_writes_them():
    assert config.load()["steering"] == {"apply_at_safe_point": True, "optimistic_concurrency": True}


@pytest.mark.parametrize("name", ["STEERING_APPLY_AT_SAFE_POINT", "STEERING_OPTIMISTIC_CONCURRENCY"])
def test_a_deployment_cannot_switch_an_invariant_off(monkeypatch, name):
    monkeypatch.setenv(name, "false")
    with pytest.raises(ImproperlyConfigured, match="must be true"):
        config.load()
