"""document_review agent against a generated corpus: counts must equal the generator's ground truth.

Pure tests: a LocalBlobStore on tmp_path and a hand-driven agent loop; no database, no engine.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from common.schema import SchemaError, validate
from runtime_site.blobstore import LocalBlobStore
from tasks_app.agents import get_agent
from tasks_app.agents.base import StepContext
from tasks_app.agents.document_review import corpus, rules
from tasks_app.agents.document_review.agent import DocumentReviewAgent
from tasks_app.agents.document_review.rules import CATEGORIES, RULES, assess, level_for

PREFIX = "corpora/test"
COUNT = 300
SEED = 7


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> LocalBlobStore:
    blobs = LocalBlobStore(Path(tmp_path_factory.mktemp("blobs")))
    corpus.generate_corpus(blobs, PREFIX, COUNT, SEED)
    return blobs


@pytest.fixture(scope="module")
def truth(store: LocalBlobStore) -> dict[str, Any]:
    return json.loads(store.get(f"{PREFIX}/truth.json"))


def make_ctx(
    store: LocalBlobStore, agent_input: dict[str, Any], step: str, seq: int, task_id: str = "task-1"
) -> StepContext:
    return StepContext(
        task_id=task_id, goal="review contracts", input=agent_input, step_name=step, sequence=seq, blobs=store
    )


def drive(
    agent: DocumentReviewAgent,
    store: LocalBlobStore,
    agent_input: dict[str, Any],
    state: dict[str, Any] | None = None,
    task_id: str = "task-1",
) -> tuple[dict[str, Any], list[dict[str, Any]], list[StepContext]]:
    """Run to completion like the engine does; returns final state, every state after a step, and the contexts."""
    validate(agent_input, agent.input_schema, "input")
    state = agent.start(agent_input, "review contracts") if state is None else state
    history: list[dict[str, Any]] = []
    contexts: list[StepContext] = []
    seq = 0
    while (step := agent.next_step(state)) is not None:
        seq += 1
        ctx = make_ctx(store, agent_input, step, seq, task_id)
        state = agent.run_step(ctx, state)
        json.dumps(state)  # checkpointable
        history.append(state)
        contexts.append(ctx)
        assert seq < 10_000, "agent did not terminate"
    return state, history, contexts


@pytest.fixture(scope="module")
def full_run(store: LocalBlobStore) -> tuple[dict[str, Any], list[dict[str, Any]], list[StepContext]]:
    return drive(DocumentReviewAgent(), store, {"corpus": PREFIX, "batchSize": 25})


def test_categories_agree_with_generator() -> None:
    assert tuple(CATEGORIES) == corpus.RISK_CATEGORIES


def test_registered() -> None:
    assert isinstance(get_agent("document_review"), DocumentReviewAgent)


def test_manifest_and_truth_written(store: LocalBlobStore, truth: dict[str, Any]) -> None:
    manifest = json.loads(store.get(f"{PREFIX}/manifest.json"))
    assert manifest["count"] == COUNT and manifest["seed"] == SEED and manifest["asOf"] == corpus.DEFAULT_AS_OF
    assert manifest["documents"][0] == f"{PREFIX}/docs/doc-00001.json"
    assert len(store.list(f"{PREFIX}/docs")) == COUNT
    assert len(truth["documents"]) == COUNT


def test_generation_is_deterministic() -> None:
    assert corpus.generate_documents(20, SEED) == corpus.generate_documents(20, SEED)
    assert corpus.generate_documents(20, SEED) != corpus.generate_documents(20, SEED + 1)


def test_corpus_is_varied(truth: dict[str, Any]) -> None:
    docs = truth["documents"].values()
    assert {t["contract_type"] for t in docs} == set(corpus.CONTRACT_TYPES)
    for category in CATEGORIES:  # every risk is planted at least a few times in 300 documents
        assert truth["totals"]["byCategory"][category] >= 5, category
    assert 0 < truth["totals"]["expired"] < COUNT // 2
    assert sum(1 for t in docs if not t["risks"]) > COUNT // 5  # plenty of clean documents too


def test_counts_match_ground_truth(full_run: Any, truth: dict[str, Any]) -> None:
    state, _, _ = full_run
    result = DocumentReviewAgent().result(state)
    assert result["documentsReviewed"] == COUNT
    assert sum(result["byLevel"].values()) == COUNT
    assert result["byCategory"] == truth["totals"]["byCategory"]
    assert result["expired"] == truth["totals"]["expired"]
    assert result["byContractType"] == dict(
        sorted(Counter(t["contract_type"] for t in truth["documents"].values()).items())
    )


def test_every_document_matches_truth_exactly(store: LocalBlobStore, truth: dict[str, Any]) -> None:
    # Stronger than equal totals: no false positive cancelling a false negative.
    for doc_id, expected in truth["documents"].items():
        doc = json.loads(store.get(f"{PREFIX}/docs/{doc_id}.json"))
        assert assess(doc).categories == expected["risks"], doc_id


def test_keyword_gates_never_change_a_finding(store: LocalBlobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # The per-clause keyword gates are a speed-up only; with them disabled every finding is the same.
    docs = [json.loads(store.get(k)) for k in store.list(f"{PREFIX}/docs")]
    gated = [assess(d) for d in docs]
    original = rules._gated
    monkeypatch.setattr(rules, "_gated", lambda clauses, words, heading=None: original(clauses, ("",), heading))
    assert [assess(d) for d in docs] == gated


def test_levels_follow_weights(full_run: Any, truth: dict[str, Any]) -> None:
    state, _, _ = full_run
    weight = {}
    for rule in RULES:
        weight[rule.category] = max(weight.get(rule.category, 0), rule.weight)
    expected = Counter(level_for(sum(weight[c] for c in t["risks"])) for t in truth["documents"].values())
    assert state["counts"]["byLevel"] == {lvl: expected.get(lvl, 0) for lvl in ("low", "medium", "high")}


def test_result_validates_and_top_risks(full_run: Any) -> None:
    state, _, _ = full_run
    agent = DocumentReviewAgent()
    result = agent.result(state)
    validate(result, agent.output_schema, "output")
    top = result["topRisks"]
    assert len(top) == 20
    assert [(-t["score"], t["id"]) for t in top] == sorted((-t["score"], t["id"]) for t in top)
    assert all(t["rules"] for t in top)


def test_bad_input_rejected() -> None:
    schema = DocumentReviewAgent.input_schema
    for bad in (
        {},
        {"corpus": PREFIX, "batchSize": 0},
        {"corpus": PREFIX, "batchSize": 501},
        {"corpus": PREFIX, "focus": ["not_a_category"]},
        {"corpus": PREFIX, "extra": 1},
        {"corpus": PREFIX, "limit": 0},
    ):
        with pytest.raises(SchemaError):
            validate(bad, schema, "input")


def test_reports_written(full_run: Any, store: LocalBlobStore) -> None:
    state, _, contexts = full_run
    refs = state["report"]
    assert refs == {
        "json": "file://tasks/task-1/artifacts/report.json",
        "markdown": "file://tasks/task-1/artifacts/report.md",
    }
    report = json.loads(store.get("tasks/task-1/artifacts/report.json"))
    assert report["summary"]["documentsReviewed"] == COUNT
    assert {r["name"] for r in report["rules"]} == {r.name for r in RULES}
    markdown = store.get("tasks/task-1/artifacts/report.md").decode()
    assert markdown.startswith("# Contract risk review") and "| Level | Documents | Share |" in markdown
    assert [a["name"] for a in contexts[-1].artifacts] == ["report.json", "report.md"]


def test_steps_progress_and_logs(full_run: Any) -> None:
    _, _, contexts = full_run
    names = [c.step_name for c in contexts]
    assert names[0] == "load_manifest" and names[-1] == "write_report"
    assert names[1:-1] == [f"review_batch_{i}" for i in range(1, COUNT // 25 + 1)]
    batches = contexts[1:-1]
    assert all(c.phase == "risk_classification" and c.logs for c in batches)
    assert batches[0].message == f"reviewed 25 of {COUNT}" and batches[-1].progress_value == 1.0
    fractions = [c.progress_value for c in batches]
    assert fractions == sorted(fractions)


def test_state_stays_small(full_run: Any) -> None:
    _, history, _ = full_run
    assert history[0]["keys"] is None  # derivable keys are not checkpointed
    assert max(len(json.dumps(s)) for s in history) < 20_000


def test_resume_from_middle_checkpoint(full_run: Any, store: LocalBlobStore) -> None:
    final, history, _ = full_run
    agent = DocumentReviewAgent()
    for middle in (history[0], history[len(history) // 2], history[-2]):
        resumed = json.loads(json.dumps(middle))  # as if restored from the checkpoint table
        again, _, _ = drive(DocumentReviewAgent(), store, {"corpus": PREFIX, "batchSize": 25}, state=resumed)
        assert agent.result(again) == agent.result(final)


def test_run_step_does_not_mutate_checkpoint(full_run: Any, store: LocalBlobStore) -> None:
    _, history, _ = full_run
    agent = DocumentReviewAgent()
    before = json.loads(json.dumps(history[3]))
    agent.run_step(make_ctx(store, {"corpus": PREFIX}, agent.next_step(before) or "", 5), history[3])
    assert history[3] == before


def test_exclude_expired(store: LocalBlobStore, truth: dict[str, Any]) -> None:
    agent = DocumentReviewAgent()
    state, _, _ = drive(agent, store, {"corpus": PREFIX, "batchSize": 40, "excludeExpired": True}, task_id="t-exp")
    result = agent.result(state)
    expired = truth["totals"]["expired"]
    assert result["documentsReviewed"] == COUNT - expired
    assert result["skipped"] == result["expired"] == expired
    live = [t for t in truth["documents"].values() if not t["expired"]]
    assert result["byCategory"] == {c: sum(c in t["risks"] for t in live) for c in CATEGORIES}
    validate(result, agent.output_schema, "output")


def test_limit_and_odd_batch_size(store: LocalBlobStore, truth: dict[str, Any]) -> None:
    agent = DocumentReviewAgent()
    state, history, _ = drive(agent, store, {"corpus": PREFIX, "batchSize": 7, "limit": 50}, task_id="t-lim")
    result = agent.result(state)
    first = [truth["documents"][f"doc-{i:05d}"] for i in range(1, 51)]
    assert result["documentsReviewed"] == 50
    assert result["byCategory"] == {c: sum(c in t["risks"] for t in first) for c in CATEGORIES}
    assert len(history) == 1 + 8 + 1  # manifest, ceil(50/7) batches, report


def test_focus_scores_only_chosen_categories(store: LocalBlobStore, truth: dict[str, Any]) -> None:
    agent = DocumentReviewAgent()
    focus = ["exclusivity", "auto_renewal"]
    state, _, _ = drive(agent, store, {"corpus": PREFIX, "focus": focus}, task_id="t-focus")
    result = agent.result(state)
    docs = truth["documents"].values()
    assert result["byCategory"] == {c: sum(c in t["risks"] for t in docs) for c in CATEGORIES if c in focus}
    assert all(set(t["categories"]) <= set(focus) for t in result["topRisks"])
    assert result["byLevel"]["high"] == 0  # two weight-2 categories cannot reach the high threshold
    validate(result, agent.output_schema, "output")


def test_missing_manifest_is_a_clear_error(tmp_path: Path) -> None:
    agent = DocumentReviewAgent()
    state = agent.start({"corpus": "nowhere"}, "")
    with pytest.raises(ValueError, match="manifest"):
        agent.run_step(make_ctx(LocalBlobStore(tmp_path), {"corpus": "nowhere"}, "load_manifest", 1), state)


def test_unreadable_documents_are_counted(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path)
    corpus.generate_corpus(blobs, "c", 10, 1)
    blobs.put("c/docs/doc-00003.json", b"{not json")
    (tmp_path / "c/docs/doc-00004.json").unlink()
    agent = DocumentReviewAgent()
    state, _, _ = drive(agent, blobs, {"corpus": "c", "batchSize": 4})
    result = agent.result(state)
    assert result["unreadable"] == 2 and result["documentsReviewed"] == 8
    assert [e["key"] for e in state["errors"]] == ["c/docs/doc-00003.json", "c/docs/doc-00004.json"]
