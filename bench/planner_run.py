"""One planner run, told step by step (issue 17's closing note): the model calls, the tool
calls with their ledger keys, a 429 retried, a worker SIGKILLed while a model call is in
flight, a question for a person, the re-plan after adjust_goal, the switch to another model
on another wire (the new model re-validating first), and the model calls and tokens per step.

    .venv/bin/python bench/planner_run.py

Against PostgreSQL and Redis (a fresh bench database), one worker (-c 1) and a beat with
short leases (3 s) so recovery after the kill is quick, the scripted model server
(tests/scripted_llm.py: the default model on the OpenAI wire, `second` on Anthropic's) and
an independent receiver counting the effects (tests/sink.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import _common

LEASES = {"RUNTIME_LEASE_SECONDS": "3", "RUNTIME_HEARTBEAT_SECONDS": "1", "RUNTIME_SCAN_SECONDS": "1"}


def main() -> None:
    os.environ.setdefault("SECURITY_HTTP_ALLOWLIST", "127.0.0.1")
    _common.setup(DATABASE_URL="postgres://postgres@127.0.0.1:5432/runtime_planner_run", **LEASES)
    import httpx

    from ledger_app.models import LedgerEntry
    from steering_app.actions import do_enqueue_command
    from steering_app.models import InputRequest
    from tasks_app.access import console
    from tasks_app.actions import do_create_task
    from tasks_app.models import AuditRecord, Step, Task, Tenant

    logs = Path(tempfile.mkdtemp(prefix="planner-run-"))
    sink_port, model_port = _common.free_port(), _common.free_port()
    sink_url, model_url = f"http://127.0.0.1:{sink_port}", f"http://127.0.0.1:{model_port}"

    def post(n: int, **extra: object) -> dict:
        return {"name": "http_request", "arguments": {"url": f"{sink_url}/effects", "json": {"n": n, **extra}}}

    def plan(*steps: tuple[str, str]) -> dict:
        return {"name": "update_plan", "arguments": {"steps": [{"title": t, "status": s} for t, s in steps]}}

    script = [
        {"toolCalls": [plan(("record the order", "doing"), ("ask for a colour", "todo")), post(1)]},
        {"status": 429},  # think-2: rate-limited once, retried by the ledger ...
        {"hangOnce": 120, "toolCalls": [{"name": "ask_person", "arguments": {"question": "Which colour?"}}]},
        # ... then in flight when the worker is SIGKILLed; asked again after recovery
        # after adjust_goal, on the Anthropic wire: re-validate the plan first, then act
        {
            "toolCalls": [
                plan(("record the order", "done"), ("ask for a colour", "done"), ("record the colour", "doing")),
                post(2, colour="blue"),
            ],
            "usage": {"input": 400, "output": 60},
        },
        {"toolCalls": [{"name": "finish", "arguments": {"answer": "order recorded, colour blue"}}]},
    ]
    script_path = logs / "script.json"
    script_path.write_text(json.dumps(script))
    models = {"second": {"provider": "anthropic", "base_url": model_url, "model": "scripted-claude"}}
    llm_env = {
        "LLM_PROVIDER": "openai",
        "LLM_BASE_URL": f"{model_url}/v1",
        "LLM_MODEL": "scripted-gpt",
        "LLM_API_KEY_ENV": "SCRIPTED_MODEL_KEY",
        "SCRIPTED_MODEL_KEY": "sk-bench",
        "LLM_BACKOFF_SECONDS": "0.2",
        "LLM_TIMEOUT_SECONDS": "300",
        "LLM_MODELS": json.dumps(models),
    }
    os.environ.update(llm_env)  # this process validates adjust_goal's model name
    from django.conf import settings

    settings.RUNTIME["llm"]["models"] = models

    procs = [
        _common.start(["tests.sink", "--port", str(sink_port)], logs / "sink.log"),
        _common.start(["tests.scripted_llm", "--port", str(model_port), "--script", str(script_path)], logs / "m.log"),
    ]
    worker = _common.worker(logs / "worker-1.log", "-l", "INFO", **llm_env)
    procs += [
        worker,
        _common.start(["celery", "-A", "runtime_site", "beat", "-s", str(logs / "beat")], logs / "beat.log"),
    ]
    client = httpx.Client(timeout=5)

    def stats(url: str) -> dict:
        try:
            return client.get(f"{url}/stats").json()
        except httpx.TransportError:
            return {}

    def status(task: Task) -> str:
        return Task.objects.values_list("status", flat=True).get(id=task.id)

    def steer(task: Task, type: str, payload: dict, command_id: str) -> None:
        version = Task.objects.values_list("state_version", flat=True).get(id=task.id)
        do_enqueue_command(
            task.id,
            tenant=tenant,
            command_id=command_id,
            type=type,
            payload=payload,
            expected_version=version,
            requested_by="user:bench",
        )

    try:
        _common.wait(lambda: stats(sink_url) and stats(model_url), timeout=30)
        tenant = Tenant.objects.create(slug="planner", name="planner")
        task, _ = do_create_task(
            console(tenant, "user:bench"),
            agent="planner",
            input={"goal": "Record the order, then the colour a person picks.", "tools": ["http.request"]},
            checkpoint_policy={"everySteps": 1},
        )
        t0 = time.monotonic()
        _common.wait(lambda: stats(model_url).get("requests") == 3, timeout=120)  # 1, the 429, the one that hangs
        os.killpg(worker.pid, signal.SIGKILL)
        killed_at = time.monotonic() - t0
        procs.append(_common.worker(logs / "worker-2.log", "-l", "INFO", **llm_env))
        _common.wait(lambda: status(task) == "input_required", timeout=120)
        asked = InputRequest.objects.get(task=task, status="open")
        steer(task, "adjust_goal", {"goal": "Record the order and the colour; say the colour.",
                                    "constraints": {"model": "second"}}, "switch")  # fmt: skip
        steer(task, "provide_input", {"key": asked.key, "answer": "blue"}, "answer")
        _common.wait(lambda: status(task) in ("completed", "failed", "dead_lettered"), timeout=180)
        task = Task.objects.get(id=task.id)
        model_stats, sink_stats = stats(model_url), stats(sink_url)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    print(f"planner run {task.id}: {task.status}; worker SIGKILLed {killed_at:.1f} s in, during think-2's model call")
    print(f"answer: {task.result and task.result['answer']!r}; plan version {task.plan_version}")
    print("\nsteps (sequence, name, attempt, worker, what the step did):")
    for step in Step.objects.filter(task=task).order_by("sequence", "attempt"):
        print(f"  {step.sequence:2d} {step.name:8s} attempt {step.attempt}  {step.worker[-12:]:12s}  "
              f"{json.dumps(step.output, sort_keys=True)[:160]}")  # fmt: skip
    print("\nledger (key = task:step:call, task id left out; tool, status, attempts, durations ms, what):")
    for entry in LedgerEntry.objects.filter(task=task).order_by("step_sequence", "call_index"):
        what = entry.tool
        if entry.tool == "llm.chat" and entry.result:
            calls = ", ".join(c["name"] for c in entry.result.get("toolCalls", [])) or "text"
            what = f"model {entry.result['model']} ({entry.result['provider']}) -> {calls}"
        print(f"  {entry.key.split(':', 1)[1]:>8s}  {entry.tool:12s} {entry.status:9s} {entry.attempts}  "
              f"{entry.durations_ms}  {what}")  # fmt: skip
    print("\naudit (seq, action, from -> to, reason):")
    for record in AuditRecord.objects.filter(task=task).order_by("seq"):
        print(f"  {record.seq:2d} {record.action:20s} {record.from_status or '':>15s} -> {record.to_status or '':15s} "
              f"{record.reason[:90]}")  # fmt: skip
    usage = task.result["usage"] if task.result else {}
    print("\nmodel calls and tokens per step:")
    per: dict[tuple[int, str], dict[str, int]] = {}
    for row in usage.get("perStep", []):
        key = (row["step"], row["name"])
        slot = per.setdefault(key, {"calls": 0, "in": 0, "out": 0})
        slot["calls"] += 1
        slot["in"] += row["inputTokens"]
        slot["out"] += row["outputTokens"]
        slot["model"] = row["model"]  # type: ignore[assignment]
    for (sequence, name), slot in sorted(per.items()):
        print(f"  step {sequence:2d} {name:8s} {slot['model']:8s} model calls {slot['calls']}  "
              f"tokens in {slot['in']:5d} out {slot['out']:4d}")  # fmt: skip
    print(f"  total: {usage.get('modelCalls')} answered model calls, {usage.get('inputTokens')} in, "
          f"{usage.get('outputTokens')} out")  # fmt: skip
    print(f"\nmodel server: {model_stats['requests']} requests ({model_stats['byWire']}), models asked "
          f"{model_stats['models']}")  # fmt: skip
    print(f"receiver: {sink_stats['effects']} effects, per key {sorted(sink_stats['perKey'].values())}")
    print(f"logs: {logs}")


if __name__ == "__main__":
    sys.exit(main())
