"""The 2025-11-25 surface for hosts that have not moved, driven by the official 1.x SDK
(mcp 1.30, its experimental task client) in its own virtual environment (.ci/mcp1-venv.sh)."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import ROOT, Processes, free_port
from tasks_app.models import Task

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def mcp1_python() -> str:
    made = subprocess.run([str(ROOT / ".ci" / "mcp1-venv.sh")], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip().splitlines()[-1]


def test_legacy_task_flow_with_the_1x_sdk(mcp1_python, alice, mallory, processes: Processes):
    port = free_port()
    processes.web(port)
    processes.worker(concurrency=2)
    other = Task.objects.create(tenant=mallory.tenant, created_by="user:0", agent="noop", input={"steps": 1})
    run = subprocess.run([mcp1_python, str(ROOT / "tests" / "mcp1_legacy_client.py"),
                          f"http://127.0.0.1:{port}/mcp", alice.token], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["protocolVersion"] == "2025-11-25"
    assert seen["tasksCapability"] == {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}
    assert seen["taskSupport"]["slow_compute"] == "optional" and seen["taskSupport"]["greet"] == "forbidden"
    assert seen["taskSupport"]["confirm_delete"] == "required"
    assert seen["created"]["status"] == "working" and seen["created"]["ttl"] == 60000
    assert seen["statuses"][-1] == "completed"
    related = seen["result"]["_meta"]["io.modelcontextprotocol/related-task"]
    assert related == {"taskId": seen["created"]["taskId"]}
    assert seen["result"]["structuredContent"]["text"] == "computed for 1s (legacy)"
    # tasks/list: only the caller's own tasks, never another tenant's
    assert seen["created"]["taskId"] in seen["listed"] and str(other.id) not in seen["listed"]
    assert seen["cancelled"] == "cancelled"  # the worker stopped at its next safe point
    assert seen["cancelAgain"] == -32602  # 2025-11-25: cancelling a terminal task is an error
    assert Task.objects.get(id=seen["cancelId"]).status == "cancelled"
    assert seen["failingStatuses"][-1] == "failed"  # 2025-11-25: isError makes the task failed
    assert seen["unknown"] == -32602
    assert seen["greet"] == "Hello, legacy!"
