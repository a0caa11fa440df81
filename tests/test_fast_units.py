"""In-process tests of modules whose other tests launch processes (the fast tier covers every module
with at least one test that can fail): the entry point's exit codes, DPFormer's memory model and
cell naming, the noise of Re-Attention's Monte Carlo, the NoisyHead audit's statistic and a sweep's
metrics, and the DPFormer figures' labels."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch


def test_the_entry_point_exits_130_with_one_line_on_ctrl_c_and_143_on_sigterm(capsys):
    from pipeline import __main__ as entry
    from pipeline import tracking

    stop = KeyboardInterrupt()
    with pytest.raises(SystemExit) as ended:
        entry._interrupted(stop)
    assert ended.value.code == 130
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C); no run was left RUNNING\n"
    stop.ended_run = True
    with pytest.raises(SystemExit):
        entry._interrupted(stop)
    assert "the run ended KILLED" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ended:
        entry._interrupted(tracking.Terminated())
    assert ended.value.code == tracking.TERMINATED == 143 and capsys.readouterr().err == ""


@pytest.mark.parametrize("overrides", [("model=transformer",), ("model=transformer_untied",), ("model=dpformer",),
                                       ("model=gru",)])
def test_the_memory_models_parameter_count_is_the_models(cfg_for, overrides):
    """``memory.parameters`` against the built model's own count: exact for a Transformer (tied or
    not, DPFormer's Re-Attention has no parameters of its own), an upper bound for a GRU."""
    from pipeline.seqrec import data, memory, train

    cfg = cfg_for("experiment=dpformer_ci", *overrides)
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
    model = train.build(cfg.model, seqs.n_items, seqs.L)
    counted = sum(p.numel() for p in model.parameters())
    estimated = memory.parameters(cfg.model, seqs.n_items, seqs.L)
    if cfg.model.arch == "transformer":
        assert estimated == counted, (estimated, counted)
    else:
        assert counted <= estimated < 2 * counted, (estimated, counted)
    need = memory.estimate(cfg, "cpu")
    users, M = memory.sizes(cfg.dataset)
    B = min(int(cfg.seqrec.batch_size), users)
    batch = min(users, B + math.ceil(4 * math.sqrt(B)))  # B plus four sds of its Poisson size
    assert need.parts["batch scores"] == int(memory.SCORE_COPIES * 4 * batch * int(cfg.dataset.L) * (M + 1))
    assert need.total == sum(need.parts.values())


def test_a_noisy_copy_has_the_errors_it_was_asked_for(cfg_for):
    """``perturb.noisy_copy``: block weights move by N(0, block_err^2), item row i by N(0, item_err_i^2),
    a row with no error (the padding row) not at all; the model itself is untouched."""
    from pipeline.seqrec import perturb, train

    cfg = cfg_for("experiment=dpformer_ci", "model=dpformer", "model.d=32")
    torch.manual_seed(0)
    model = train.build(cfg.model, 200, 8).double()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    item_err = torch.full((201,), 0.3, dtype=torch.float64)
    item_err[0] = 0.0
    noisy = perturb.noisy_copy(model, 0.05, item_err, torch.Generator().manual_seed(1))
    moved = {n: (p - before[n]) for n, p in noisy.named_parameters()}
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    items = next(d for n, d in moved.items() if n.startswith("items."))
    assert torch.equal(items[0], torch.zeros_like(items[0]))
    assert items[1:].std().item() == pytest.approx(0.3, rel=0.05)  # 200 x 32 draws: 1.3% sd of the sd
    blocks = torch.cat([d.flatten() for n, d in moved.items() if not n.startswith("items.")])
    assert blocks.std().item() == pytest.approx(0.05, rel=0.05) and abs(blocks.mean().item()) < 0.002


def test_the_audit_statistic_projects_on_the_selection_runs_mean_difference():
    from pipeline.noisyhead.audit import statistic

    first = torch.tensor([[1.0, 0.0], [3.0, 2.0], [10.0, 10.0]])
    second = torch.tensor([[0.0, 0.0], [0.0, 2.0], [-10.0, 10.0]])
    a, b = statistic(first, second, n_sel=2)  # u = mean of the first two rows' difference = (2, 0)
    np.testing.assert_array_equal(a, [2.0, 6.0, 20.0])
    np.testing.assert_array_equal(b, [0.0, 0.0, -20.0])


def test_a_sweeps_metrics_are_each_methods_extremes_and_its_size(cfg_for):
    from pipeline.noisyhead import sweep

    cfg = cfg_for("regime=lowdim")
    rows = [{"method": m, "N": N, "eps": 0.2, "attack_c": None, "attack_p": None, "B": 7, "coupling": None,
             "T": 40, "excess_risk_mean": v, "attack_risk_mean": math.nan}
            for m, values in (("noisyhead", (3.0, 1.5)), ("ridge", (0.0, 0.0))) for N, v in zip((1000, 2000), values)]
    found = sweep.metrics(pd.DataFrame(rows), cfg)
    assert found["cells"] == 2 and found["trials"] == 7
    assert found["noisyhead_excess_risk_mean_min"] == 1.5 and found["noisyhead_excess_risk_mean_max"] == 3.0
    assert not any(k.startswith("ridge") for k in found)  # the oracle is not plotted
    assert not any("attack_risk" in k for k in found)  # a measure nobody has is left out, not NaN


def test_dpformer_cells_are_named_by_what_tells_them_apart(cfg_for):
    from pipeline.seqrec import cell
    from pipeline.seqrec.plot import _eps_text, label

    cfg = cfg_for("experiment=dpformer_ci", "model=dpformer", "seed=3", "privacy.eps=5")
    assert cell.cell_name(cfg).startswith("dpformer eps=5 seed=3 (phantom, lr=")
    assert cell.headline_params(cfg)["seed"] == 3
    rows = [{"split": "test", "method": "dpformer", "ndcg10": 0.2, "hit10": 0.4},
            {"split": "valid", "method": "dpformer", "ndcg10": 0.3, "hit10": 0.5},
            {"split": "test", "method": "most popular", "ndcg10": 0.9, "hit10": 0.9}]
    assert cell.headline_metrics(rows, "dpformer", 10) == {"test_ndcg10": 0.2, "test_hit10": 0.4, "valid_ndcg10": 0.3}
    assert label("transformer", "none") == "transformer (non-private)" and label("gru", "phantom") == "gru"
    assert _eps_text(float("inf")) == "non-private" and _eps_text(8.0) == "ε = 8"


def test_xdist_groups_reach_the_ids_the_scheduler_reads():
    """A test marked ``xdist_group`` under ``--dist loadgroup`` carries the group in its node id
    (what pytest-xdist's scheduler groups on); unmarked tests and other modes are left alone."""
    from types import SimpleNamespace

    import conftest

    class Item:
        def __init__(self, nodeid, group):
            from _pytest.nodeid import coerce_node_id

            self._id = coerce_node_id(nodeid)
            self._group = group

        @property
        def nodeid(self):
            return str(self._id)

        def iter_markers(self, name):
            return [SimpleNamespace(args=(self._group,), kwargs={})] if self._group and name == "xdist_group" else []

    items = [Item("tests/test_a.py::test_x[1]", "inputs"), Item("tests/test_a.py::test_y", None)]
    conftest._xdist_groups(SimpleNamespace(option=SimpleNamespace(loadgroup=True)), items)
    assert [i.nodeid for i in items] == ["tests/test_a.py::test_x[1]@inputs", "tests/test_a.py::test_y"]
    conftest._xdist_groups(SimpleNamespace(option=SimpleNamespace(loadgroup=True)), items)  # idempotent
    assert items[0].nodeid == "tests/test_a.py::test_x[1]@inputs"
    other = [Item("tests/test_a.py::test_x[1]", "inputs")]
    conftest._xdist_groups(SimpleNamespace(option=SimpleNamespace(loadgroup=False)), other)
    assert other[0].nodeid == "tests/test_a.py::test_x[1]"
