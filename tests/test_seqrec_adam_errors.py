"""Re-Attention's errors under Adam (``model.reattention.errors=adam``, pipeline/seqrec/reattention.py,
point 4 of its docstring): the O(T) recursion against the direct sum, against Adam run on pure
noise, and against the spread between DP trainings that differ only in their noise draws; and what
a run with it does (its errors step by step, no histogram, its name)."""

import math

import numpy as np
import pytest
import torch

from pipeline.seqrec import reattention as ra, train


def direct(lrs, beta1):
    """e_t by the definition: sqrt(sum_k c_k(t)^2), c_k(t) = sum_(j=k..t) a_j beta1^(j-k), O(T^2)."""
    out = []
    for t in range(1, len(lrs) + 1):
        c = [sum(lrs[j - 1] * (1 - beta1) / (1 - beta1 ** j) * beta1 ** (j - k) for j in range(k, t + 1))
             for k in range(1, t + 1)]
        out.append(math.sqrt(sum(x * x for x in c)))
    return np.array(out)


@pytest.mark.parametrize("beta1", [0.9, 0.5, 0.0])
def test_recursion_is_the_direct_sum(beta1):
    lrs = np.random.default_rng(0).uniform(0.0, 0.02, size=40)
    assert ra.adam_errors(lrs, beta1) == pytest.approx(direct(lrs, beta1), rel=1e-12)
    # beta1 = 0: each step moves by lr_t xi_t, so e_t^2 is the running sum of lr^2
    if beta1 == 0.0:
        assert ra.adam_errors(lrs, beta1) == pytest.approx(np.sqrt(np.cumsum(lrs ** 2)), rel=1e-12)


@pytest.mark.parametrize("noise_std", [1e-3, 0.3])
@pytest.mark.parametrize("steps,lr", [(20, 0.01), (60, 0.005)])
def test_against_adam_on_pure_noise(steps, lr, noise_std):
    """torch's Adam, the training's schedule, gradients N(0, s^2) only: the parameters' std after
    every step is e_t whatever s (to 3%: Adam's v_hat is s^2 estimated from few draws early on)."""
    factor = train.schedule(steps, 0.2)
    expect = ra.adam_errors([lr * factor(s) for s in range(steps)], train.ADAM_BETAS[0])
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(100_000, dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=lr, betas=train.ADAM_BETAS, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    got = []
    for _ in range(steps):
        p.grad = noise_std * torch.randn(p.shape, dtype=p.dtype)
        opt.step()
        sched.step()
        got.append(float(p.detach().std()))
    assert np.array(got) == pytest.approx(expect, rel=0.03)


def _twins(cfg_for, eps, seeds=(101, 202, 303)):
    """Trainings of the vanilla Transformer on the CI data, identical (initialisation, Poisson
    samples) but for the DP noise draws; their parameters and the run's plan."""
    from pipeline.dpsgd import noise as dp_noise
    from pipeline.seqrec import data

    cfg = cfg_for("experiment=dpformer_ci", "model=transformer", "seqrec.epochs=10", f"privacy.eps={eps}")
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
    plan = train.plan(cfg, seqs.n_users)
    original = dp_noise.noisy_gradient  # the shared trainer's (pipeline.dpsgd): one generator samples and noises
    params = []
    try:
        for seed in seeds:
            noise = torch.Generator().manual_seed(seed)

            def only_the_noise_differs(*args, generator=None, noise=noise, **kw):
                return original(*args, generator=noise, **kw)

            dp_noise.noisy_gradient = only_the_noise_differs
            model, _ = train.run(seqs, cfg, plan)
            params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    finally:
        dp_noise.noisy_gradient = original
    return params, plan, cfg, seqs


def _spread(params, name, rows=None):
    x = torch.stack([p[name] if rows is None else p[name][rows] for p in params])
    return float(x.var(0, unbiased=True).mean().sqrt())


@pytest.mark.slow
def test_matches_the_spread_of_trainings_that_differ_only_in_their_noise(cfg_for):
    """Issue 20, point 3: under Adam the noise leaves about the same spread in every parameter group,
    whatever sigma; the derived e_T predicts it (block weights and tail items within 10% at eps 1 and 8,
    whose noise multipliers differ about 5-fold; head items, whose gradients carry signal, less)."""
    spreads = {}
    for eps in (1, 8):
        params, plan, cfg, seqs = _twins(cfg_for, eps)
        e_T = float(train.adam_errors(cfg, plan)[-1])
        weights = [n for n in params[0] if n.startswith("blocks.") and n.endswith("weight") and ".ln" not in n]
        block = math.sqrt(np.mean([_spread(params, n) ** 2 for n in weights]))
        counts = ra.item_counts(seqs.train, seqs.n_items)
        order = torch.argsort(counts[1:], stable=True) + 1
        tail, head = order[: len(order) // 2], order[-len(order) // 10:]
        spreads[eps] = (plan.sigma, block / e_T, _spread(params, "items.weight", tail) / e_T,
                        _spread(params, "items.weight", head) / e_T)
    (s1, *low), (s8, *high) = spreads[1], spreads[8]
    assert s1 > 4 * s8  # the paper's errors sigma C / (B p_i) differ as much
    for block, tail, head in (low, high):
        assert 0.9 < block < 1.1 and 0.85 < tail < 1.1 and 0.75 < head < 1.05
    assert high[0] == pytest.approx(low[0], rel=0.1)  # the same spread whatever sigma


TINY = ["experiment=dpformer_ci", "model=dpformer", "dataset.n_users=80", "dataset.L=10", "seqrec.batch_size=20",
        "seqrec.epochs=2", "model.reattention.errors=adam"]


@pytest.mark.slow
def test_a_run_corrects_for_the_error_its_parameters_carry_at_each_step(cfg_for, monkeypatch):
    from pipeline.seqrec import data

    cfg = cfg_for(*TINY)
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
    plan = train.plan(cfg, seqs.n_users)
    expect = train.adam_errors(cfg, plan)
    seen = []
    original = ra.DPFormer.set_uniform_errors
    monkeypatch.setattr(ra.DPFormer, "set_uniform_errors", lambda self, e: (seen.append(e), original(self, e)))
    monkeypatch.setattr(ra, "calibrate", lambda *a, **k: pytest.fail("errors=adam uses no item presence"))
    model, _ = train.run(seqs, cfg, plan)
    per = plan.steps_per_epoch
    assert plan.steps == 2 * per == 8
    # per epoch: the error before each of its steps (0 before the first), then the one after its last
    want = []
    for epoch in range(2):
        want += [0.0 if epoch == s == 0 else float(expect[epoch * per + s - 1]) for s in range(per)]
        want.append(float(expect[(epoch + 1) * per - 1]))
    want.append(float(expect[-1]))  # and once more when training returns (a resumed run may skip every epoch)
    assert seen == pytest.approx(want, rel=1e-12)
    assert model.block_err == pytest.approx(expect[-1], rel=1e-12)
    assert model.item_err[0] == 0 and torch.allclose(model.item_err[1:], torch.tensor(expect[-1], dtype=model.item_err.dtype))


@pytest.mark.slow
def test_a_run_resumed_after_its_last_epoch_still_corrects_with_e_T(cfg_for, tmp_path):
    """The errors are not checkpointed (a buffer and an attribute): a run killed after its last epoch and
    relaunched restores every epoch and must still evaluate with e_T, not as a plain Transformer."""
    from pipeline.seqrec import data

    cfg = cfg_for(*TINY)
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
    plan = train.plan(cfg, seqs.n_users)
    path = tmp_path / "checkpoint.pt"
    train.run(seqs, cfg, plan, checkpoint=path, digest="d")
    resumed, history = train.run(seqs, cfg, plan, checkpoint=path, resume=True, digest="d")
    assert history.resumed_from == 2
    assert resumed.block_err == pytest.approx(train.adam_errors(cfg, plan)[-1], rel=1e-12) and resumed.active


@pytest.mark.slow
def test_no_histogram_no_eps_share_and_a_name_of_its_own(cfg_for):
    from pipeline import tasks

    adam = cfg_for(*TINY)
    paper = cfg_for(*TINY[:-1])  # presence=private: the histogram takes eps_share of the budget
    tasks.validate(adam)
    a, p = train.plan(adam, 80), train.plan(paper, 80)
    assert a.presence_multiplier == 0 and p.presence_multiplier > 0
    assert a.sigma < p.sigma and a.eps_spent == pytest.approx(8.0, abs=0.01)
    assert train.model_name(adam.model) == "dpformer:errors-adam"
    # presence does not enter an errors=adam run, so its name does not carry it
    assert train.model_name(cfg_for(*TINY, "model.reattention.presence=public").model) == "dpformer:errors-adam"
    assert train.model_name(cfg_for(*TINY, "model.reattention.form=off").model) == "dpformer:form-off:errors-adam"


def test_a_bad_errors_value_is_refused_naming_the_key(cfg_for):
    from pipeline import tasks
    from pipeline.validation import ConfigError

    with pytest.raises(ConfigError, match=r"model\.reattention\.errors"):
        tasks.validate(cfg_for(*TINY[:-1], "model.reattention.errors=sgd"))
