"""Prometheus metrics, scraped from real processes and read with prometheus-client's own
parser: the web process's /metrics (what the database and the broker know, its SSE
streams and pool) and a worker's own port (what its pool processes counted)."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from conftest import FAST_LEASES, Processes, SseClient, answers, free_port, purge_queues, settled, wait_until
from ledger_app.models import LedgerEntry
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task
from tasks_app.tasks import scan_leases
from tests.test_ledger import FAST, Sink, webhook

pytestmark = pytest.mark.django_db(transaction=True)


def noop(persona, *, steps: int, priority: int = 5, **extra) -> Task:
    return do_create_task(
        console(persona.tenant, "user:test"), agent="noop", input={"steps": steps, **extra}, priority=priority
    )[0]


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of one scrape."""
    response = httpx.get(url, timeout=15)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_the_web_process_reports_tasks_inputs_effects_queues_streams_and_its_pool(alice, processes: Processes):
    purge_queues()
    port = free_port()
    processes.web(port)
    metrics = f"http://127.0.0.1:{port}/metrics"
    # Arranged straight in the database (the truth the scrape reads): one of each kind.
    queued = noop(alice, steps=2, priority=0)  # its message waits: no worker runs yet
    held = noop(alice, steps=1)
    Task.objects.filter(id=held.id).update(status="dead_lettered")
    lost = noop(alice, steps=1)
    Task.objects.filter(id=lost.id).update(status="recovering")
    Task.objects.filter(id=lost.id).update(updated_at=timezone.now() - timedelta(minutes=5))
    for status, n in (("unknown", 1), ("pending", 2)):
        for i in range(n):
            LedgerEntry.objects.create(
                tenant=alice.tenant,
                task=held,
                step_sequence=1,
                call_index=i,
                tool="x",
                key=f"{held.id}:{status}:{i}",
                fingerprint="f",
                status=status,
                lease_epoch=1,
            )
    stream = SseClient(f"http://127.0.0.1:{port}/runtime/tasks/{queued.id}/events", alice.token)
    wait_until(lambda: stream.of("task.snapshot"), timeout=15, what="the stream to open")

    samples = scrape(metrics)
    assert value(samples, "runtime_tasks", status="queued") == 1
    assert value(samples, "runtime_tasks", status="dead_lettered") == 1
    assert value(samples, "runtime_dead_letters") == 1
    assert value(samples, "runtime_tasks", status="recovering") == 1
    assert value(samples, "runtime_tasks_recovering_oldest_age_seconds") >= 290
    assert value(samples, "runtime_ledger_entries", status="unknown") == 1
    assert value(samples, "runtime_ledger_entries", status="pending") == 2
    # Priority 0 is the most urgent step; the two others (priority 5) wait in step 3.
    assert value(samples, "runtime_queue_depth", queue="steps", priority="0") == 1
    assert value(samples, "runtime_queue_depth", queue="steps", priority="3") == 2
    assert value(samples, "runtime_queue_oldest_message_age_seconds", queue="steps", priority="0") > 0
    assert value(samples, "runtime_sse_open_streams") == 1
    assert value(samples, "runtime_db_pool_connections", state="in_use") >= 1  # this scrape's own
    assert value(samples, "runtime_db_pool_max") == 20
    assert {value(samples, "runtime_scrape_error", source=s) for s in ("database", "broker", "web")} == {0}
    assert value(samples, "runtime_tasks_waiting_for_input") == 0

    # A worker takes the queue; the task asks a person at its first step.
    stream.close()
    asking = noop(alice, steps=2, askAt=1)
    processes.worker(**FAST_LEASES)
    settled(asking)
    settled(queued)
    samples = scrape(metrics)
    assert value(samples, "runtime_queue_depth", queue="steps", priority="0") == 0
    assert value(samples, "runtime_tasks", status="queued") == 0
    assert value(samples, "runtime_tasks_waiting_for_input") == 1
    assert value(samples, "runtime_tasks_waiting_for_input_oldest_age_seconds") > 0


def test_the_web_port_serves_metrics_to_this_host_or_to_the_bearer_of_the_metrics_token(processes: Processes):
    """The web port is the public one: /metrics was open to anyone who could reach it."""
    port, guarded = free_port(), free_port()
    processes.web(port)
    metrics = f"http://127.0.0.1:{port}/metrics"
    assert httpx.get(metrics, timeout=15).status_code == 200  # bin/run, a sidecar, an SSH tunnel
    # A client that a proxy on this host forwards (uvicorn believes 127.0.0.1's X-Forwarded-For) is elsewhere.
    refused = httpx.get(metrics, headers={"X-Forwarded-For": "203.0.113.7"}, timeout=15)
    assert refused.status_code == 403
    assert "RUNTIME_METRICS_TOKEN" in refused.json()["error"]["message"]

    processes.web(guarded, RUNTIME_METRICS_TOKEN="scrape-me-0123456789")
    metrics = f"http://127.0.0.1:{guarded}/metrics"
    for headers, challenge in (
        ({}, 'Bearer realm="metrics"'),  # with a token set, this host must send it too
        ({"Authorization": "Bearer scrape-me-01234567"}, 'Bearer realm="metrics", error="invalid_token"'),
        ({"Authorization": "Basic scrape-me-0123456789"}, 'Bearer realm="metrics", error="invalid_token"'),
    ):
        answer = httpx.get(metrics, headers=headers, timeout=15)
        assert (answer.status_code, answer.headers["www-authenticate"]) == (401, challenge), headers
        assert answer.json()["error"]["code"] in ("not_authenticated", "authentication_failed")
    for client in ("127.0.0.1", "203.0.113.7"):
        answer = httpx.get(
            metrics,
            headers={"Authorization": "Bearer scrape-me-0123456789", "X-Forwarded-For": client},
            timeout=15,
        )
        assert answer.status_code == 200 and "runtime_tasks" in answer.text


def test_a_worker_serves_what_its_pool_processes_counted(alice, processes: Processes):
    # A worker vanished mid-slice: the lease expired, and only the reaper may hand the task on
    # (its creation message is gone, so no worker claims it first).
    orphan = noop(alice, steps=1)
    Task.objects.filter(id=orphan.id).update(
        status="working", lease_owner="gone:1", lease_epoch=1, lease_expires_at=timezone.now() - timedelta(seconds=5)
    )
    purge_queues()
    sink = Sink(processes)
    port = free_port()
    processes.worker(concurrency=2, RUNTIME_METRICS_PORT=str(port), **FAST)
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/metrics"), timeout=30, what="the worker's metrics port")
    posting = webhook(alice, sink, count=3)
    counting = noop(alice, steps=4)
    scan_leases.delay()
    for task in (posting, counting, orphan):
        assert settled(task).status == "completed"

    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    assert value(samples, "runtime_step_duration_seconds_count", agent="noop", outcome="ok") == 5
    assert value(samples, "runtime_step_duration_seconds_count", agent="webhook", outcome="ok") == 3
    assert value(samples, "runtime_tool_calls_total", tool="http.request", outcome="ok") == 3
    assert sink.stats()["posts"] == 3
    assert value(samples, "runtime_recoveries_total", outcome="recovering") == 1
    assert value(samples, "runtime_slices_total", outcome="done") == 3
    started = value(samples, "runtime_slice_start_latency_seconds_count")
    assert started >= 3 and value(samples, "runtime_slice_start_latency_seconds_sum") >= 0
    assert value(samples, "runtime_lease_takeovers_total") == 0


def test_alerts_and_the_dashboard_use_only_metrics_we_export():
    import json
    import re

    import yaml

    from conftest import ROOT

    exported = set(re.findall(r'"(runtime_[a-z_]+)"', (ROOT / "runtime_site" / "metrics.py").read_text()))
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    panels = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "runtime.json").read_text())["panels"]
    expressions = [r["expr"] for r in rules] + [t["expr"] for p in panels for t in p["targets"]]
    used = {
        re.sub(r"_(bucket|count|sum)$", "", name) for e in expressions for name in re.findall(r"runtime_[a-z_]+", e)
    }
    assert used and used <= exported, used - exported
    assert {
        "runtime_dead_letters",
        "runtime_tasks_recovering_oldest_age_seconds",
        "runtime_ledger_entries",
        "runtime_queue_oldest_message_age_seconds",
        "runtime_recoveries_total",
    } <= {name for r in rules for name in re.findall(r"runtime_[a-z_]+", r["expr"])}
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["description"]


def test_a_task_recovering_for_long_shows_its_age_although_the_scanner_re_rings_it(alice, processes: Processes):
    """The lease scanner touches a runnable task it re-enqueues (leases.stalled), every
    stall_seconds; RuntimeTasksStuckRecovering (> 600 s) must still see how long it has waited."""
    from tasks_app import leases, operators
    from tasks_app.models import AuditRecord

    lost = noop(alice, steps=1)
    Task.objects.filter(id=lost.id).update(
        status="working", lease_owner="gone:1", lease_epoch=1, lease_expires_at=timezone.now() - timedelta(seconds=5)
    )
    assert operators.do_mark_recovering(lost.id, actor="system:reaper").status == "recovering"
    purge_queues()  # no worker consumes the steps queue
    long_ago = timezone.now() - timedelta(minutes=20)
    AuditRecord.objects.filter(task=lost, to_status="recovering").update(created_at=long_ago)
    Task.objects.filter(id=lost.id).update(updated_at=long_ago)
    assert [task_id for task_id, _ in leases.stalled(stall_seconds=60)] == [lost.id]  # one scan, re-ringing it
    port = free_port()
    processes.web(port)
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    assert value(samples, "runtime_tasks_recovering_oldest_age_seconds") >= 20 * 60


def _rules() -> list[dict]:
    import yaml

    from conftest import ROOT

    return [
        r
        for g in yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
        for r in g["rules"]
    ]


def test_each_condition_of_the_issue_has_an_alert_and_the_guide_says_what_to_do():
    import re

    from conftest import ROOT

    alerts = {r["alert"] for r in _rules()}
    # dead letters, tasks stuck recovering, queue age, unknown effects, lease churn
    assert {
        "RuntimeDeadLetters",
        "RuntimeTasksStuckRecovering",
        "RuntimeQueueAge",
        "RuntimeUnknownEffects",
        "RuntimeLeaseChurn",
    } <= alerts
    guide = (ROOT / "docs" / "operations.md").read_text().split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    explained = {
        m.group(1): (m.group(2).strip(), m.group(3).strip())
        for m in re.finditer(r"^\| `(\w+)` \|([^|]+)\|([^|]+)\|$", guide, re.M)
    }
    assert alerts == set(explained), alerts ^ set(explained)
    assert all(means and do for means, do in explained.values())
    # ... and the metrics table lists every metric we export.
    exported = set(re.findall(r'"(runtime_[a-z_]+)"', (ROOT / "runtime_site" / "metrics.py").read_text()))
    listed = (ROOT / "docs" / "operations.md").read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    missing = exported - set(re.findall(r"runtime_[a-z_]+", listed))
    assert not missing, missing


def test_alert_rules_are_well_formed_without_promtool():
    """What promtool would catch first, for these rules: a malformed duration, unbalanced
    brackets, a label in a message that the expression aggregates away (it renders empty),
    a job that Prometheus does not scrape."""
    import re

    import yaml

    from conftest import ROOT

    jobs = {
        job["job_name"]
        for job in yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    }
    for rule in _rules():
        expr, name = rule["expr"], rule["alert"]
        assert re.fullmatch(r"\d+[smhd]", rule["for"]), name
        for opening, closing in ("()", "{}", "[]"):
            depth = 0
            for char in expr:
                depth += (char == opening) - (char == closing)
                assert depth >= 0, (name, expr)
            assert depth == 0, (name, expr)
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert re.fullmatch(r"\d+[smhd]", window), (name, window)
        assert set(re.findall(r'job="([^"]+)"', expr)) <= jobs, name
        kept = re.findall(r"\bby \(([^)]*)\)", expr)
        aggregated = re.search(r"\b(sum|max|min|avg|count)\b", expr)
        text = " ".join(rule["annotations"].values())
        for label in re.findall(r"\$labels\.(\w+)", text):
            assert not aggregated or any(label in [k.strip() for k in by.split(",")] for by in kept), (name, label)


def test_a_worker_removes_the_metrics_folders_that_killed_workers_left(processes: Processes, tmp_path):
    """A SIGKILLed worker never runs its exit hook: its multiprocess folder stayed in /tmp for
    good, one more per crash. The next worker started on the host removes it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    first = processes.worker(RUNTIME_METRICS_PORT=str(free_port()), TMPDIR=str(tmp), **FAST)
    left = wait_until(lambda: list(tmp.glob(f"runtime-metrics-{first.pid}-*")), timeout=30, what="its folder")
    processes.kill(first)
    assert left[0].exists()
    port = free_port()
    second = processes.worker(RUNTIME_METRICS_PORT=str(port), TMPDIR=str(tmp), **FAST)
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/metrics"), timeout=30, what="the worker's metrics port")
    assert not left[0].exists()
    assert list(tmp.glob(f"runtime-metrics-{second.pid}-*"))  # its own stays


def test_this_host_over_ipv4_written_as_ipv6_may_scrape(settings):
    """A dual-stack socket (or a proxy on one) reports an IPv4 client in its IPv6 form: this
    host's 127.0.0.1 as ::ffff:127.0.0.1, which Python 3.12's is_loopback calls no loopback."""
    settings.RUNTIME_METRICS_TOKEN = ""
    for address, status in [("::ffff:127.0.0.1", 200), ("::1", 200), ("::ffff:203.0.113.7", 403)]:
        assert Client(REMOTE_ADDR=address).get("/metrics").status_code == status, address
