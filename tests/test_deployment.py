"""compose.yaml runs exactly the commands the tests start, with secrets from the environment."""

from __future__ import annotations

import yaml

from conftest import BEAT, ROOT, WEB, WORKER


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


def test_compose_runs_the_tested_commands():
    services = compose()
    web = services["web"]["command"]
    assert web[:3] == WEB[:3] and web[4:-1] == WEB[4:] and web[3] == "0.0.0.0"
    assert services["worker"]["command"] == [*WORKER, "2"]
    assert services["worker"]["deploy"]["replicas"] == 2
    assert services["beat"]["command"][:-1] == BEAT


def test_compose_has_the_whole_stack_and_bakes_in_no_secrets():
    services = compose()
    assert {"web", "worker", "beat", "postgres", "redis", "minio"} <= set(services)
    assert "--appendonly" in services["redis"]["command"]  # Redis with persistence
    text = (ROOT / "compose.yaml").read_text()
    for secret in ("DJANGO_SECRET_KEY", "POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD"):
        assert f"${{{secret}:?" in text  # required from the environment, no default
