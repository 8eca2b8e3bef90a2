"""compose.yaml runs exactly the commands the tests start, with secrets from the environment."""

from __future__ import annotations

import shlex

import yaml

from conftest import BEAT, ROOT, WEB, WORKER


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


def test_compose_runs_the_tested_commands():
    services = compose()
    web = services["web"]["command"]
    assert web[:3] == WEB[:3] and web[4:-1] == WEB[4:] and web[3] == "0.0.0.0"  # noqa: S104 (in its container)
    assert services["worker"]["command"] == [*WORKER, "2"]
    assert services["worker"]["deploy"]["replicas"] == 2
    assert services["beat"]["command"][:-1] == BEAT


def test_bin_run_starts_the_tested_commands():
    """bin/run (the embedded profile, and a developer's) starts the same three processes as
    compose and the tests; only the log level and the values of its shell variables differ."""

    def normalized(words: list[str]) -> list[str]:
        out = []
        for word in words:
            if out and out[-1] == "--log-level":
                out.pop()  # uvicorn's (the tests' runs at its default)
            elif out and out[-1] == "-l":
                out.append("INFO")
            else:
                out.append(word)
        return out

    started = [
        normalized(shlex.split(line.split(" & ", 1)[0]))
        for line in (ROOT / "bin" / "run").read_text().splitlines()
        if line.startswith(("uvicorn ", "celery ")) and " & pids+=" in line
    ]
    assert started == [
        [*WEB, "$PORT"],
        [*WORKER, "2"],
        [*BEAT, "$RUNTIME_DATA_DIR/celerybeat-schedule"],
    ]


def test_compose_has_the_whole_stack_and_bakes_in_no_secrets():
    services = compose()
    assert {"web", "worker", "beat", "postgres", "redis", "minio"} <= set(services)
    assert "--appendonly" in services["redis"]["command"]  # Redis with persistence
    text = (ROOT / "compose.yaml").read_text()
    for secret in ("DJANGO_SECRET_KEY", "POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD"):
        assert f"${{{secret}:?" in text  # required from the environment, no default


def test_compose_file_follows_the_compose_specification():
    """deploy/compose-spec.json is the Compose Specification's schema/compose-spec.json, vendored."""
    import json

    import jsonschema

    schema = json.loads((ROOT / "deploy" / "compose-spec.json").read_text())
    document = yaml.safe_load((ROOT / "compose.yaml").read_text())
    errors = [
        f"{'/'.join(map(str, e.path))}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(document)
    ]
    assert errors == []


def test_health_checks_use_the_probes_and_each_workers_metrics_port():
    services = compose()
    assert "/readyz" in " ".join(services["web"]["healthcheck"]["test"])
    port = services["worker"]["environment"]["RUNTIME_METRICS_PORT"]
    assert f"127.0.0.1:{port}/metrics" in " ".join(services["worker"]["healthcheck"]["test"])
    assert services["beat"]["healthcheck"] == {"disable": True}  # the image's check is the web's
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    jobs = {job["job_name"]: job for job in scrape}
    assert jobs["runtime-web"]["static_configs"][0]["targets"] == ["web:8000"]
    # The web's /metrics is on its public port: Prometheus sends the token the web requires.
    assert services["web"]["environment"]["RUNTIME_METRICS_TOKEN"].startswith("${RUNTIME_METRICS_TOKEN:?")
    assert jobs["runtime-web"]["authorization"] == {"credentials_file": "/run/secrets/metrics_token"}
    assert "metrics_token" in services["prometheus"]["secrets"]
    assert yaml.safe_load((ROOT / "compose.yaml").read_text())["secrets"]["metrics_token"] == {
        "environment": "RUNTIME_METRICS_TOKEN"
    }
    assert "\nRUNTIME_METRICS_TOKEN=" in (ROOT / ".env.example").read_text()
    assert jobs["runtime-worker"]["dns_sd_configs"][0] == {
        "names": ["worker"],
        "type": "A",
        "port": int(port),
        "refresh_interval": "15s",
    }


def test_the_observability_profile_mounts_files_that_exist():
    services = compose()
    observability = {name for name, service in services.items() if "observability" in service.get("profiles", [])}
    assert observability == {"otel-collector", "jaeger", "prometheus", "grafana"}
    for name in observability:
        for volume in services[name].get("volumes", []):
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"
    collector = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    assert "http://otel-collector:4318" in (ROOT / ".env.example").read_text()


def test_the_image_runs_as_a_user_collects_static_files_and_checks_its_health():
    dockerfile = (ROOT / "Dockerfile").read_text()
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert "manage.py collectstatic --noinput" in dockerfile
    assert "manage.py collectstatic --noinput" in (ROOT / "bin" / "run").read_text()  # every profile
    healthcheck = next(line for line in dockerfile.splitlines() if line.startswith("HEALTHCHECK"))
    assert "/healthz" in dockerfile.split(healthcheck, 1)[1].split("\nCMD", 1)[0]
    assert {"var", ".venv", ".env"} <= set((ROOT / ".dockerignore").read_text().split())  # no local secrets baked in


def test_the_observability_tools_are_reachable_from_this_host_only_and_grafana_has_no_default_password():
    """Jaeger, Prometheus and Grafana have no sign-in of their own worth the name (Grafana's
    is admin/admin until someone changes it): published on every interface, anyone who
    reaches the host reads the traces, the metrics and the dashboards first."""
    services = compose()
    for name in ("jaeger", "prometheus", "grafana"):
        for port in services[name].get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password.startswith("${GRAFANA_ADMIN_PASSWORD:?"), password
    assert "\nGRAFANA_ADMIN_PASSWORD=" in (ROOT / ".env.example").read_text()
