"""The Hugging Face zoo (benchmarks/clipping_zoo.py): its per-family run on families the engine
handles exactly and on one it refuses, docs/clipping.md's table against the committed run, and (slow)
the whole zoo through main()."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import clipping_zoo as zoo
from pipeline.clipping import PhantomClipping, Unsupported

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model_type, tied", [("gpt2", "transformer.wte.weight"),
                                              ("qwen2", "model.embed_tokens.weight")])
def test_tied_families_as_shipped_are_exact(model_type, tied):
    """GPT-2 (Conv1D, learned positions) and Qwen2 (RMSNorm, rotary, grouped queries) with their own
    forward, padding and default position ids: the tie is found and the norms and the clipped sum are
    the brute force's in float64."""
    row = zoo.run_family(model_type, "causal")
    assert row["built"] and not row["moe"], row
    assert row["outcome"] == "exact", row
    assert row["error"] < zoo.TOL and row["norms_error"] < zoo.TOL and row["sum_error"] < zoo.TOL
    assert tied in row["ties"] and len(row["ties"][tied]) == 2, row["ties"]


def test_a_refused_family_is_refused_with_its_reason():
    """T5's relative-attention bias is one table read for the whole batch (no batch dimension): the row
    says ``refused`` with the engine's reason, the one ``Unsupported`` it raises on that model."""
    row = zoo.run_family("t5", "seq2seq")
    assert row["built"] and not row["moe"], row
    assert row["outcome"] == "refused" and "relative_attention_bias" in row["reason"], row
    model, config = zoo.build("t5", "seq2seq")
    batch = zoo.make_batch(model, config, "seq2seq")
    with pytest.raises(Unsupported, match=r"\w") as refused:
        engine = PhantomClipping(model, C=1.0)
        engine.per_example_norms(zoo.per_example_loss, batch)
        engine.step(zoo.per_example_loss, batch)
    assert str(refused.value) == row["reason"]


def test_a_family_past_its_timeout_is_killed_and_recorded():
    """A worker that gives no row within the timeout (here: still starting) is killed and the family
    recorded as an ``error`` of the worker, so that one hanging family cannot stop the zoo."""
    seen = []
    rows = zoo.run_all([{"model_type": "gpt2", "kind": "causal", "class": "GPT2LMHeadModel"}], workers=1,
                       timeout=0.5, chunk=8, report=lambda row, done, total: seen.append((done, total)))
    assert [(r["outcome"], r["stage"]) for r in rows] == [("error", "worker")] and seen == [(1, 1)]
    assert rows[0]["reason"].startswith("timeout")


def test_the_docs_table_is_the_committed_run():
    """docs/clipping.md's block between the zoo's markers is the one generated from docs/clipping_zoo.json."""
    saved = json.loads((ROOT / "docs/clipping_zoo.json").read_text())
    assert zoo.docs_block((ROOT / "docs/clipping.md").read_text()) == zoo.markdown(saved)
    assert saved["summary"] == zoo.summary(saved["rows"])


@pytest.mark.slow
def test_the_whole_zoo_runs_and_nothing_mismatches(tmp_path):
    """Every family through main() with --json: each row has a build status and, when built, an outcome;
    the counts add up; no norm or clipped sum differs from the brute force (a mismatch would be a privacy
    bug)."""
    out = tmp_path / "zoo.json"
    rows = zoo.main(["--json", str(out), "--workers", "2"])
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and len(rows) == len(zoo.families())
    for row in rows:
        assert row.get("outcome") in ("exact", "refused", "error") or row.get("build_error"), row
    counts = saved["summary"]
    assert sum(counts["dense"].values()) + sum(counts["moe"].values()) == counts["families"] == len(rows)
    assert not [r["model_type"] for r in rows if r.get("outcome") == "mismatch"]
