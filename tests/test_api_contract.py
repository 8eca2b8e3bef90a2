"""The REST API's contract (runtime_site/openapi.py): the served schema documents every
operation, and a real uvicorn holds to it under schemathesis with all of its checks."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree

import httpx
import pytest
from django.core.management import call_command
from django.test import Client

from conftest import ROOT, Processes, free_port, make_persona

pytestmark = pytest.mark.django_db(transaction=True)

SSE_PATH = "/runtime/tasks/{task_id}/events"
# The fuzzer sends far more requests than a client may (config/runtime.yaml `limits`): it tests
# the contract, not the limits (tests/test_rate_limits.py does), so its server runs without them,
# as the benchmarks' do (bench/_common.py).
NO_REST_LIMITS = {"LIMITS_REST_PER_KEY": "0", "LIMITS_REST_PER_TENANT": "0"}


def test_generating_the_schema_logs_no_error_or_warning(tmp_path: Path):
    # --fail-on-warn: drf-spectacular's warnings and errors fail the command; --validate: the result
    # is checked against the OpenAPI 3 meta-schema.
    call_command(
        "spectacular",
        "--validate",
        "--fail-on-warn",
        "--format",
        "openapi-json",
        "--file",
        str(tmp_path / "schema.json"),
    )


def test_the_served_schema_documents_every_operation(processes: Processes):
    port = free_port()
    processes.web(port)
    schema = httpx.get(f"http://127.0.0.1:{port}/runtime/schema?format=json", timeout=30).json()

    bearer = schema["components"]["securitySchemes"]["bearerAuth"]
    assert (bearer["type"], bearer["scheme"]) == ("http", "bearer")
    error = schema["components"]["schemas"]["Error"]
    assert error["required"] == ["error"]
    operations = {(path, method): op for path, item in schema["paths"].items() for method, op in item.items()}
    assert len(operations) == 19
    metadata = operations.pop(("/.well-known/oauth-protected-resource", "get"))
    assert (
        metadata["security"] == []
        and "resource" in metadata["responses"]["200"]["content"]["application/json"]["schema"]["required"]
    )
    for (path, method), op in operations.items():
        assert op["security"] == [{"bearerAuth": []}], (method, path)
        ok = [code for code in op["responses"] if code.startswith("2")]
        assert ok, (method, path)
        # Every authenticated request counts against its key's and tenant's rate limits.
        assert "Retry-After" in op["responses"]["429"]["headers"], (method, path)
        # A 401 says why (RFC 6750 §3): tasks_app.auth.challenge.
        assert op["responses"]["401"]["headers"]["WWW-Authenticate"]["required"] is True, (method, path)
        for code, response in op["responses"].items():
            assert response.get("content"), f"{method} {path} {code}: no body documented"
            if not code.startswith("2"):
                assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    for path in (
        "/runtime/tasks/{task_id}/cancel",
        "/runtime/tasks/{task_id}/steering",
        "/runtime/tasks/{task_id}/inputs/{key}",
        "/runtime/tasks",
    ):
        assert operations[(path, "post")]["requestBody"]["content"]["application/json"]["schema"], path
    assert {p["name"] for p in operations[("/runtime/tasks", "get")]["parameters"]} == {"status", "limit", "cursor"}
    assert "text/event-stream" in operations[(SSE_PATH, "get")]["responses"]["200"]["content"]
    for path in ("/runtime/keys", "/runtime/keys/{key_id}/rotate"):
        assert (
            "token"
            in schema["components"]["schemas"][
                operations[(path, "post")]["responses"]["201"]["content"]["application/json"]["schema"]["$ref"].rsplit(
                    "/", 1
                )[1]
            ]["required"]
        ), path
    steering = operations[("/runtime/tasks/{task_id}/steering", "post")]
    command = schema["components"]["schemas"]["SteeringCommandOut"]
    assert "killPolicy" in command["properties"] and "killPolicy" not in command["required"]
    request = steering["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert (
        "kill"
        in schema["components"]["schemas"][
            schema["components"]["schemas"][request]["properties"]["type"]["$ref"].rsplit("/", 1)[1]
        ]["enum"]
    )


def test_schemathesis_with_every_check_finds_no_server_error_and_no_schema_violation(
    processes: Processes, tmp_path: Path
):
    ada = make_persona("acme", "ada", "admin")
    port = free_port()
    processes.web(port, **NO_REST_LIMITS)
    report = tmp_path / "report.xml"
    started = time.monotonic()
    run = subprocess.run(
        [
            str(Path(sys.executable).with_name("st")),
            "--config-file",
            str(ROOT / "tests" / "schemathesis.toml"),
            "run",
            f"http://127.0.0.1:{port}/runtime/schema?format=json",
            "--checks",
            "all",
            "--header",
            f"Authorization: Bearer {ada.token}",
            # An event stream never ends, so no response is ever complete: documented, not fuzzed.
            "--exclude-path",
            SSE_PATH,
            # Revoking a key is tested in tasks_app/tests/test_api_keys.py: here the stateful phase
            # would find the fuzzer's own key in GET /runtime/keys and revoke it, and every later
            # request would be a (correct) 401.
            "--exclude-operation-id",
            "revokeKey",
            "--max-examples",
            "25",
            "--seed",
            "16",
            "--workers",
            "2",
            "--request-timeout",
            "10",
            "--generation-database",
            "none",
            "--no-color",
            "--report",
            "junit",
            "--report-junit-path",
            str(report),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # its caches stay out of the repository
    print(run.stdout[-3000:], run.stderr[-2000:], f"schemathesis took {time.monotonic() - started:.1f}s", sep="\n")
    assert run.returncode == 0, run.stdout[-8000:]
    suite = ElementTree.parse(report).getroot()  # noqa: S314 (schemathesis's own report, written just now)
    # Sixteen operations (all but the stream and revokeKey) and the stateful scenarios, each with every check.
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("18", "0", "0")


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("cancel", {"reason": 0}, "reason"),
        ("steering", {"commandId": 7, "type": "pause", "expectedVersion": 1}, "commandId"),
        ("steering", {"commandId": "c1", "type": "pause", "expectedVersion": "1"}, "expectedVersion"),
    ],
)
def test_a_field_of_another_json_type_is_refused_not_coerced(alice, path, body, field):
    # DRF would store 0 as "0" and "1" as 1; the schema promises a string and an integer.
    client = alice.client()
    created = client.post("/runtime/tasks", {"agent": "noop", "input": {"steps": 3}}, format="json")
    response = client.post(f"/runtime/tasks/{created.json()['taskId']}/{path}", body, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request" and field in response.json()["error"]["fields"]


def test_a_format_the_schema_or_the_api_does_not_serve_is_a_400_naming_it(alice):
    """?format= chooses a renderer; one nobody has was DRF's Http404 (\"no such task\", in
    YAML on the schema), and an Accept the schema cannot meet a YAML 406."""
    client = Client(raise_request_exception=False)
    for path, headers in (("/runtime/schema", {}), ("/runtime/tasks", {"HTTP_AUTHORIZATION": f"Bearer {alice.token}"})):
        for wanted in ("xml", "openapi", "YAML"):
            response = client.get(f"{path}?format={wanted}", **headers)
            assert (response.status_code, response["Content-Type"]) == (400, "application/json"), response.content
            error = response.json()["error"]
            assert list(error["fields"]) == ["format"] and repr(wanted) in error["message"], error
        assert client.get(f"{path}?format=json", **headers).status_code == 200
    assert client.get("/runtime/schema?format=yaml").status_code == 200
    refused = client.get("/runtime/schema", HTTP_ACCEPT="application/xml")
    assert (refused.status_code, refused["Content-Type"]) == (406, "application/json"), refused.content
    assert "Accept" in refused.json()["error"]["message"]
