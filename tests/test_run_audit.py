"""The whole-run audit (``pipeline/canaries.py``, ``pipeline/lm/audit.py``): Dirac canaries join
exactly the steps that sample them, their bits stay hidden until scoring, and a real DP-SGD run of
the language model is audited: the run as planned is never flagged, the controls raise the bound,
and a run without noise is a violation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.canaries import DiracCanaries
from pipeline.lm import audit, examples, models

EOS = 0


def test_dirac_canaries_add_c_to_their_coordinate_when_sampled_and_score_the_noisy_sums():
    params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    can = DiracCanaries(params, m=10, C=2.0, sample_rate=0.5, seed=1)
    truth = can.reveal()
    for _ in range(40):
        for p in params:
            p.grad = torch.zeros_like(p)
        can.add()
        can.observe()
    # no noise, no data: a canary's score is the number of steps that sampled it
    assert np.array_equal(can.scores(), can.sampled.astype(float))
    assert np.all(can.sampled[~truth] == 0) and np.all(can.sampled[truth] > 0)
    flat = torch.cat([p.grad.view(-1) for p in params])
    assert int((flat != 0).sum()) <= 10 and set(flat.unique().tolist()) <= {0.0, 2.0}
    with pytest.raises(ValueError, match="m = 18 canaries need as many parameter coordinates"):
        DiracCanaries(params, m=18, C=1.0, sample_rate=0.5, seed=0)


def _setup():
    g = torch.Generator().manual_seed(0)
    posts = [[1 + (int(torch.randint(0, 3, (1,), generator=g)) + k) % 30 for k in range(7)] + [EOS] for _ in range(100)]
    rows, mask = examples.training_rows(posts, L=7, eos_id=EOS)

    def build():
        torch.manual_seed(0)
        return models.build(vocab_size=40, max_len=8, d=16, layers=1, heads=2, tied=True, dropout=0.0, eos_id=EOS)

    return build, rows, mask


def test_each_control_is_a_plan_the_accountant_was_not_told_of():
    from pipeline import privacy
    from pipeline.lm import train

    claimed = train.plan(n_posts=100, batch_size=10, epochs=5, eps=1.0, delta=1e-5, private=True, vocab_share=0.0)
    plans = {v: audit.actual_plan(claimed, v, eps=1.0, delta=1e-5, accountant="prv") for v in audit.VARIANTS}
    assert plans["engine"] == claimed
    assert plans["noise_halved"].sigma == claimed.sigma / 2 and plans["no_noise"].sigma == 0.0
    assert plans["sampling_doubled"].sample_rate == 2 * claimed.sample_rate
    tenth = plans["accountant_tenth"]
    assert tenth.steps == claimed.steps and tenth.sigma < claimed.sigma
    assert privacy.dpsgd_spent_epsilon(sigma=tenth.sigma, delta=1e-5, sample_rate=0.1, steps=5,
                                       accountant="prv") == pytest.approx(1.0, abs=0.02)
    with pytest.raises(ValueError, match="unknown audit variant"):
        audit.actual_plan(claimed, "half", eps=1.0, delta=1e-5, accountant="prv")


@pytest.mark.slow
def test_a_dp_sgd_run_is_audited_its_controls_raise_the_bound_and_no_noise_is_caught():
    build, rows, mask = _setup()
    found = {v: audit.run(build, rows, mask, variant=v, eps=1.0, delta=1e-5, batch_size=10, epochs=5, C=1.0,
                          lr=1e-2, m=1000, seed=0) for v in ("engine", "noise_halved", "no_noise")}
    engine, halved, bare = found["engine"], found["noise_halved"], found["no_noise"]
    assert engine["verdict"] != "violation" and engine["eps_lower"] < 1.0
    assert 1.8 * engine["mu_used"] < halved["mu_used"] <= 2 * engine["mu_used"]  # q(1 - q) adds to both variances
    assert halved["eps_lower"] > engine["eps_lower"]
    assert bare["verdict"] == "violation" and bare["eps_lower"] > 1.0
    # at this size a 2x violation of eps = 1 cannot be shown: said, not hidden
    assert engine["power"] < 1.0 and halved["verdict"].startswith("too weak to say")
