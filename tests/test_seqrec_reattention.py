"""Re-Attention (pipeline/seqrec/reattention.py): moment formulas against Table 3 and Monte Carlo,
LayerNorm's moments against Monte Carlo, every block's propagated logit variance against Monte
Carlo over noisy parameters (at initialisation and trained, at the CPU presets' errors and the full
Amazon data's), the zero-noise model against the vanilla Transformer, the corrected scores, and
Phantom Clipping's exact norms."""

import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from pipeline.seqrec import models, reattention as ra, train
from pipeline.clipping import PhantomClipping
from pipeline.seqrec import clipping

from test_seqrec_clipping import IDS, ROWS, TARGETS, L, M  # the clipping tests' users: repeats, padding, shared items


def build(reattention=True, blocks=2, dropout=0.0, d=8, seed=1):
    torch.manual_seed(seed)
    cfg = dict(arch="transformer", d=d, heads=1, blocks=blocks, d_ff=16, dropout=dropout, tied=True,
               init_std=0.3, layers=1)
    if reattention:
        cfg["reattention"] = {"presence": "public"}
    return train.build(OmegaConf.create(cfg), M, L).double()


def mc_moments(f, mu, std, n=1_000_000, seed=0):
    x = mu + std * torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    y = f(x)
    return y.mean().item(), y.var().item()


@pytest.mark.parametrize("std,table", [(0.01, 3.40e-5), (0.1, 0.0034), (1.0, 0.3408)])
def test_relu_variance_matches_table_3(std, table):
    # Table 3's N(0, s) has standard deviation s: Var ReLU = s^2 (1/2 - 1/(2 pi))
    _, var = ra.relu_moments(torch.tensor(0.0, dtype=torch.float64), torch.tensor(std ** 2, dtype=torch.float64))
    assert var.item() == pytest.approx(std ** 2 * (0.5 - 0.5 / math.pi), rel=1e-12)
    assert abs(var.item() - table) < 1e-3 * std ** 2 + 1e-12  # table rounded to its digits


def test_printed_eq_5_6_gives_one_half_the_corrected_0_3408():
    c, d = 0.0, 1.0
    phi, Phi = math.exp(-c * c / (2 * d)) / math.sqrt(2 * math.pi), 0.5
    printed = Phi * (c * c + d) + c * math.sqrt(d) * phi - c * c
    _, var = ra.relu_moments(torch.tensor(c, dtype=torch.float64), torch.tensor(d, dtype=torch.float64))
    assert printed == 0.5 and var.item() == pytest.approx(0.3408, abs=1e-4)


@pytest.mark.parametrize("fn,moments", [(F.relu, ra.relu_moments), (F.gelu, ra.gelu_moments)])
@pytest.mark.parametrize("mu,std", [(0.0, 1.0), (0.7, 0.3), (-0.5, 2.0), (0.2, 0.01)])
def test_activation_moments_against_monte_carlo(fn, moments, mu, std):
    mean, var = moments(torch.tensor(mu, dtype=torch.float64), torch.tensor(std ** 2, dtype=torch.float64))
    mc_mean, mc_var = mc_moments(fn, mu, std)
    se = math.sqrt(mc_var / 1e6)
    assert abs(mean.item() - mc_mean) < 5 * se
    assert mc_var * 0.99 < var.item() < mc_var * 1.01


@pytest.mark.parametrize("std,sampled", [(0.01, 2.49e-5), (0.1, 0.0025), (1.0, 0.3467)])
def test_gelu_variance_near_table_3_sampled_column(std, sampled):
    _, var = ra.gelu_moments(torch.tensor(0.0, dtype=torch.float64), torch.tensor(std ** 2, dtype=torch.float64))
    assert var.item() == pytest.approx(sampled, rel=0.03)  # Table 3: 1e6 samples, 2-3 digits


def test_zero_variance_activations_are_deterministic():
    mu = torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64)
    for fn, moments in ((F.relu, ra.relu_moments), (F.gelu, ra.gelu_moments)):
        mean, var = moments(mu, torch.zeros(3, dtype=torch.float64))
        torch.testing.assert_close(mean, fn(mu))
        assert (var.abs() < 1e-15).all()


def test_linear_variance_against_monte_carlo():
    g = torch.Generator().manual_seed(3)
    d_in, d_out, n = 5, 3, 400_000
    mu = torch.randn(d_in, generator=g, dtype=torch.float64)
    var = torch.rand(d_in, generator=g, dtype=torch.float64) * 0.5
    W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    b, err = torch.randn(d_out, generator=g, dtype=torch.float64), 0.4
    x = mu + var.sqrt() * torch.randn(n, d_in, generator=g, dtype=torch.float64)
    Wn = W + err * torch.randn(n, d_out, d_in, generator=g, dtype=torch.float64)
    y = (Wn @ x[..., None]).squeeze(-1) + b + err * torch.randn(n, d_out, generator=g, dtype=torch.float64)
    torch.testing.assert_close(ra.linear_var(mu, var, W, err, True), y.var(0), rtol=0.02, atol=0)


def test_gumbel_mean_is_euler_not_pi2_over_6():
    # E max_j (x_j + gamma_j) = logsumexp(x) + zeta, zeta the Gumbel mean (Eq. 5.1-5.2)
    g = torch.Generator().manual_seed(4)
    x = torch.tensor([0.3, -1.0, 2.0, 0.5], dtype=torch.float64)
    u = torch.rand(400_000, 4, generator=g, dtype=torch.float64)
    noisy_max = (x - torch.log(-torch.log(u))).max(1).values
    zeta = (noisy_max.mean() - torch.logsumexp(x, 0)).item()
    assert zeta == pytest.approx(ra.EULER_GAMMA, abs=0.01) and abs(zeta - math.pi ** 2 / 6) > 0.5


def test_item_presence_and_effective_errors():
    p = ra.item_presence(ROWS, M)
    users = ROWS.shape[0]
    expected = [max(sum(int(i in row.tolist()) for row in ROWS), 1) / users for i in range(M + 1)]
    expected[0] = 1.0
    torch.testing.assert_close(p, torch.tensor(expected, dtype=torch.float64))
    block, items = ra.effective_errors(2.0, 0.5, 10, p)
    assert block == 0.1 and items[0] == 0
    torch.testing.assert_close(items[1:], 0.1 / p[1:])  # sigma_dp C / (B p_i), Eq. C.3


def test_one_block_logit_variance_against_monte_carlo_over_noisy_parameters():
    model = build(blocks=1).eval()
    g = torch.Generator().manual_seed(5)
    block_err = 0.05
    item_err = torch.rand(M + 1, generator=g, dtype=torch.float64) * 0.3
    item_err[0] = 0
    model.set_errors(block_err, item_err)
    record = []
    with torch.no_grad():
        model(IDS, record=record)
    lv = record[0]["var"][:, 0]  # (n, T, T)
    # Monte Carlo: noisy item and position tables and noisy key weights, the mean model's query
    n_mc, ids = 20_000, IDS
    n, T = ids.shape
    mask = (ids != 0)[..., None].double()
    E, P = model.items.weight.detach(), model.positions.weight.detach()[L - T:]
    attn = model.blocks[0].attn
    Wk, bk = attn.k.weight.detach(), attn.k.bias.detach()
    with torch.no_grad():
        q = attn.q(E[ids] * mask + P)  # (n, T, d)
    d = E.shape[1]
    En = E + item_err[:, None] * torch.randn(n_mc, M + 1, d, generator=g, dtype=torch.float64)
    Pn = P + block_err * torch.randn(n_mc, T, d, generator=g, dtype=torch.float64)
    Wn = Wk + block_err * torch.randn(n_mc, d, d, generator=g, dtype=torch.float64)
    bn = bk + block_err * torch.randn(n_mc, 1, d, generator=g, dtype=torch.float64)
    x = En[:, ids] * mask + Pn[:, None]  # (n_mc, n, T, d)
    K = x @ Wn.transpose(-1, -2)[:, None] + bn[:, None]
    logits = q @ K.transpose(-1, -2) / math.sqrt(d)  # (n_mc, n, T, T)
    mc = logits.var(0)
    torch.testing.assert_close(lv, mc, rtol=0.06, atol=1e-12)
    assert lv.min() > 0


@pytest.mark.parametrize("token_scale, noise_scale", [(1.0, 0.01), (1.0, 0.3), (0.08, 0.05), (0.08, 1.0), (1.0, 5.0)])
def test_layer_norm_moments_against_monte_carlo(token_scale, noise_scale):
    """x_hat = LN(r') for r' = r + noise, independent coordinates of unequal variances, from noise 1/100
    of the token's scale to 60 times it: the propagated mean and variance against 20,000 draws (the
    variance within 12% per coordinate; taking the token's mean and scale as constants, the earlier
    release's rule, is off 200-fold at token 0.08, noise 1)."""
    g = torch.Generator().manual_seed(3)
    d = 64
    r = token_scale * torch.randn(d, generator=g, dtype=torch.float64)
    v = noise_scale**2 * 2 * torch.rand(d, generator=g, dtype=torch.float64)
    x = r + v.sqrt() * torch.randn(20_000, d, generator=g, dtype=torch.float64)
    xhat = (x - x.mean(-1, keepdim=True)) / (x.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    mean, var = ra.normalised_moments(r, v, 1e-5)
    ratio = var / xhat.var(0)
    assert 0.88 < float(ratio.min()) and float(ratio.max()) < 1.12, ratio
    se = (xhat.var(0) / 20_000).sqrt()
    assert float(((mean - xhat.mean(0)).abs() / (xhat.std(0) + 1e-12)).median()) < 0.1 + 3 * float((se / xhat.std(0)).max())
    assert float(var.max()) <= d - 1


# The errors of the two scales (Claims 5.3-5.4 computed for the presets' runs): the block error
# sigma_dp C / B and the item errors sigma_dp C / (B p_i), whose middle 90% spans these ranges:
# Amazon Games' 500 most frequent items (the CPU preset before it sampled users) at B = 512, eps = 8
# (items 0.06 to 0.23); the full Amazon Games data at B = 1024, eps = 5 (items 6 to 45, the long
# tail's rows far noisier than the embeddings). The present amazon_games_cpu (2,000 sampled users,
# B = 512, eps = 8) lies between them: items 0.85 to 4.3, inside the range these two bracket.
SCALES = {"cpu_preset": (0.0017, 0.06, 0.23), "full_amazon": (0.0018, 6.0, 45.0)}


def _set_scale(model, scale: str, g: torch.Generator) -> None:
    """The block error of ``SCALES[scale]`` and item errors log-uniform between its two item bounds."""
    block, low, high = SCALES[scale]
    items = torch.exp(math.log(low) + (math.log(high) - math.log(low)) *
                      torch.rand(model.item_err.numel(), generator=g, dtype=torch.float64))
    items[0] = 0
    model.set_errors(block, items)


def _ratio_quantiles(rec: dict, mc: torch.Tensor, real: torch.Tensor) -> list[float]:
    """5th, 50th and 95th percentiles of the recorded / Monte Carlo logit variances over the real
    (query, key) pairs the attention allows."""
    shown = (rec["att"] > 0) & real[:, None, :, None] & real[:, None, None, :]
    ratio = (rec["var"] / mc)[shown]
    return torch.quantile(ratio, torch.tensor([0.05, 0.5, 0.95], dtype=ratio.dtype)).tolist()


_TRAINED = {}  # the trained model, once per test process (each test gets a copy)


def _trained_dpformer(cfg_for):
    """A DPFormer (paper's d = 64, 2 blocks) trained without noise on the CI data: attention and
    LayerNorm scales away from initialisation."""
    import copy

    if "model" not in _TRAINED:
        _TRAINED["model"] = _train_dpformer(cfg_for)
    model, rows = _TRAINED["model"]
    return copy.deepcopy(model), rows


def _train_dpformer(cfg_for):
    from pipeline.seqrec import data

    cfg = cfg_for("experiment=dpformer_ci", "model=dpformer", "model.d=64", "model.d_ff=64", "privacy.eps=inf",
                  "seqrec.epochs=4", "model.dropout=0.0")
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
    torch.manual_seed(0)
    model, _ = train.run(seqs, cfg, train.plan(cfg, seqs.n_users))
    return model.double().eval(), seqs.train


@pytest.mark.slow
@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("state", ["init", "trained"])
def test_every_blocks_logit_variance_against_monte_carlo(state, scale, cfg_for):
    """Every block's propagated logit variances against 400 noisy copies of the model
    (``pipeline/seqrec/perturb.py``): per block, the median ratio within 15% of 1 and 90% of the
    logits (real query and key positions) within [0.8, 1.4]. Monte Carlo's own error is 7% per
    logit (sd of a variance from 400 draws). The trained model's block-2 attention is far from
    uniform (its largest weight 4x the uniform one at the median), where block 2's keys need the
    covariance between their input's coordinates (``keyvar``). Measured: block 1 (0.90-0.91,
    0.995-1.00, 1.09-1.16); block 2 (0.86-0.92, 1.00-1.02, 1.11-1.19) except trained at the full
    data's errors (1.00, 1.14, 1.38). Dropping the covariance (the per-coordinate rule alone, as the
    paper) gave trained block 2 a lower 5% of 0.69; the earlier release's LayerNorm rule was 4x off at
    the median in block 2 at the CPU preset's errors, 1,200x at the full data's."""
    from pipeline.seqrec import perturb

    if state == "trained":
        model, rows = _trained_dpformer(cfg_for)
    else:
        from pipeline.seqrec import data

        cfg = cfg_for("experiment=dpformer_ci", "model=dpformer", "model.d=64", "model.d_ff=64")
        seqs = data.load(cfg.dataset, int(cfg.dataset.L), 0)
        torch.manual_seed(0)
        model, rows = train.build(cfg.model, seqs.n_items, seqs.L).double().eval(), seqs.train
    g = torch.Generator().manual_seed(7)
    _set_scale(model, scale, g)
    longest = (rows[:, :-1] != 0).sum(1).argsort(descending=True)[:4]
    ids = rows[longest, :-1]
    record = []
    with torch.no_grad():
        model(ids, record=record)
    mc = perturb.logit_variance(model, ids, 400, g)
    real = ids != 0
    assert len(mc) == len(record) == 2
    for b, (rec, m) in enumerate(zip(record, mc)):
        low_q, median, high_q = _ratio_quantiles(rec, m, real)
        assert 0.85 < median < 1.15 and low_q > 0.8 and high_q < 1.4, (b, low_q, median, high_q)
    if state == "trained":  # block 2 attends far from uniformly: what the covariance matters for
        att, allowed = record[1]["att"], (record[1]["att"] > 0).sum(-1)
        assert float((att.max(-1).values * allowed)[real[:, None, :]].median()) > 3


@pytest.mark.slow
@pytest.mark.parametrize("scale", list(SCALES))
def test_sampled_form_every_blocks_logit_variance_against_monte_carlo(scale, cfg_for):
    """form=sampled against Monte Carlo over noisy copies that are themselves sampled models (each corrects
    its attention as a noisy model would, from its own draws), on the trained model of the test above:
    per block, the median ratio within [0.8, 1.25] and its 5th percentile above 0.5 (issue 41's targets).
    With 32 draws a logit's sampled variance has a relative sd of about sqrt(2 / 31), 25%; Monte Carlo's
    own, from 200 copies, 10%. Measured at these settings (2026-11-27, both scales): block 1 (0.71-0.72,
    0.96-0.98, 1.61-1.64), block 2 (0.75-0.77, 1.07-1.08, 1.44-1.53)."""
    from pipeline.seqrec import perturb

    model, rows = _trained_dpformer(cfg_for)
    model.form, model.draws = "sampled", 32
    g = torch.Generator().manual_seed(7)
    _set_scale(model, scale, g)
    ids = rows[(rows[:, :-1] != 0).sum(1).argsort(descending=True)[:4], :-1]
    record = []
    with torch.no_grad():
        model(ids, record=record)
    mc = perturb.logit_variance(model, ids, 200, g)
    real = ids != 0
    for b, (rec, m) in enumerate(zip(record, mc)):
        low_q, median, high_q = _ratio_quantiles(rec, m, real)
        assert 0.8 <= median <= 1.25 and low_q > 0.5, (b, low_q, median, high_q)
        assert torch.equal(rec["used"], rec["var"])


def test_each_draws_own_variance_is_over_the_others():
    g = torch.Generator().manual_seed(3)
    qs, ks = (torch.randn(5, 2, 1, 4, 3, generator=g, dtype=torch.float64) + 10 for _ in range(2))
    own = ra._own_variances(qs, ks)
    for i in range(5):
        others = torch.cat([ks[:i], ks[i + 1:]])
        torch.testing.assert_close(own[i], (qs[i] @ others.transpose(-1, -2) / math.sqrt(3)).var(0),
                                   rtol=1e-10, atol=0)


def test_sampled_form_draws_are_the_steps_not_the_batchs():
    """form=sampled: a user's scores do not depend on the other users of its batch (the draws are of the
    whole item table, per step), the same step draws the same, another step other draws; the correction
    moves the scores; with zero errors the model is the vanilla Transformer."""
    model = build().eval()
    model.form, model.draws = "sampled", 8
    model.set_errors(0.05, torch.full((M + 1,), 0.5, dtype=torch.float64))
    with torch.no_grad():
        whole = model(IDS)
        for i in range(IDS.shape[0]):
            torch.testing.assert_close(model(IDS[i:i + 1])[0], whole[i], rtol=1e-12, atol=1e-12)
        assert torch.equal(model(IDS), whole)
        model.at_step(1)
        other = model(IDS)
        assert not torch.allclose(other, whole)
        model.at_step(0)
        off = _with(model, form="off")
        assert not torch.allclose(off(IDS), whole)
        model.set_errors(0.0, torch.zeros(M + 1, dtype=torch.float64))
        assert torch.equal(model(IDS), off(IDS))


def test_zero_noise_is_the_vanilla_transformer_exactly():
    vanilla, dpformer = build(False, dropout=0.3).train(), build(True, dropout=0.3).train()
    dpformer.load_state_dict(vanilla.state_dict())
    dpformer.set_errors(0.0, torch.zeros(M + 1))
    torch.manual_seed(7)
    a = vanilla(IDS)
    torch.manual_seed(7)
    b = dpformer(IDS)
    assert torch.equal(a, b)
    # the Re-Attention forward itself, with errors too small to move a logit, gives the same scores
    dpformer.eval().set_errors(1e-200, torch.full((M + 1,), 1e-200))
    assert dpformer.active
    torch.testing.assert_close(dpformer(IDS), vanilla.eval()(IDS), rtol=1e-12, atol=1e-12)


def _with(model, **kw):
    """The same model (weights, errors) built with other ablation settings."""
    from pipeline.seqrec.reattention import DPFormer

    other = build(blocks=len(model.blocks))
    other.form, other.corrected = kw.get("form", "propagated"), kw.get("corrected")
    other.load_state_dict(model.state_dict())
    other.set_errors(model.block_err, model.item_err)
    assert isinstance(other, DPFormer)
    return other.eval()


def test_ablation_off_is_the_vanilla_attention_with_the_same_variances():
    """form=off: the scores of the vanilla Transformer with the same weights, though the errors are
    set and the variances still propagated (and recorded)."""
    model = build().eval()
    model.set_errors(0.05, torch.full((M + 1,), 0.3, dtype=torch.float64))
    vanilla = build(False).eval()
    vanilla.load_state_dict(model.state_dict())
    off = _with(model, form="off")
    record = []
    with torch.no_grad():
        torch.testing.assert_close(off(IDS, record=record), vanilla(IDS), rtol=1e-12, atol=1e-12)
        assert not torch.allclose(model(IDS), vanilla(IDS))
    assert all(float(r["var"].max()) > 0 and float(r["used"].abs().max()) == 0 for r in record)


def test_ablation_paper_form_is_the_propagated_one_when_key_coordinates_are_independent():
    """Eq. 5.2's form drops the covariance between the key's coordinates; with a diagonal W_k on
    independent inputs there is none, and the two forms agree; with a full W_k they differ."""
    model = build(blocks=1).eval()
    model.set_errors(0.05, torch.full((M + 1,), 0.3, dtype=torch.float64))
    paper = _with(model, form="paper")
    rec_p, rec_m = [], []
    with torch.no_grad():
        paper(IDS, record=rec_p)
        assert (rec_p[0]["used"] - rec_p[0]["var"]).abs().max() > 1e-3 * rec_p[0]["var"].max()
        for m in (model, paper):
            m.blocks[0].attn.k.weight.copy_(torch.diag(torch.linspace(0.5, 2.0, 8, dtype=torch.float64)))
        paper(IDS, record=rec_p)
        model(IDS, record=rec_m)
    torch.testing.assert_close(rec_p[-1]["used"], rec_m[-1]["used"], rtol=1e-10, atol=1e-14)


def test_ablation_blocks_corrects_only_the_blocks_named():
    model = build().eval()
    model.set_errors(0.05, torch.full((M + 1,), 0.3, dtype=torch.float64))
    second = _with(model, corrected=[2])
    off = _with(model, form="off")
    rec_s, rec_o = [], []
    with torch.no_grad():
        second(IDS, record=rec_s)
        off(IDS, record=rec_o)
    assert float(rec_s[0]["used"].abs().max()) == 0 and torch.equal(rec_s[0]["att"], rec_o[0]["att"])
    assert torch.equal(rec_s[1]["used"], rec_s[1]["var"]) and not torch.equal(rec_s[1]["att"], rec_o[1]["att"])


def test_ablations_are_named_apart_in_results(cfg_for):
    names = {train.model_name(cfg_for(*TINY, *o).model) for o in
             ((), ("model.reattention.form=off",), ("model.reattention.form=paper",), ("model.reattention.blocks=[2]",),
              ("model.reattention.form=paper", "model.reattention.blocks=[1,2]"))}
    assert names == {"dpformer", "dpformer:form-off", "dpformer:form-paper", "dpformer:blocks-2",
                     "dpformer:form-paper:blocks-1_2"}
    assert train.model_name(cfg_for(*TINY, "model=transformer").model) == "transformer"
    # the privacy assumption is part of the name: presence=private is the default
    assert cfg_for(*TINY).model.reattention.presence == "private"
    assert train.model_name(cfg_for(*TINY, "model=dpformer_public").model) == "dpformer:presence-public"


def test_corrected_scores_are_the_divided_and_renormalised_distribution():
    model = build().eval()
    model.set_errors(0.2, torch.linspace(0, 1.5, M + 1, dtype=torch.float64))
    record = []
    with torch.no_grad():
        model(IDS, record=record)
    n, T = IDS.shape
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    allowed = causal & ((IDS != 0)[:, None, :] | torch.eye(T, dtype=torch.bool))
    for block, r in zip(model.blocks, record):
        att, var = r["att"][:, 0], r["var"][:, 0]
        assert (att >= 0).all() and (att[~allowed] == 0).all()
        torch.testing.assert_close(att.sum(-1), torch.ones(n, T, dtype=torch.float64))
        # S_i / exp(Var_i / 2), renormalised: the vanilla weights of the same inputs, reweighted
        assert (var[allowed] > 0).all()
    x, mask = model.embed(IDS)
    x = x + model.positions.weight[L - T:]
    with torch.no_grad():
        attn = model.blocks[0].attn
        s = attn.q(x) @ attn.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        vanilla = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        w = vanilla / torch.exp(record[0]["var"][:, 0] / 2)
        torch.testing.assert_close(record[0]["att"][:, 0], w / w.sum(-1, keepdim=True))


@pytest.mark.parametrize("form", ["propagated", "sampled"])
def test_phantom_norms_exact_for_dpformer(form):
    """(form=sampled: the draws are a function of the step alone, so each user's forward alone sees the
    correction it saw in the batch, and the draws run as tensor operations no engine hook sees.)"""
    model = build().train()
    model.form, model.draws = form, 4
    model.set_errors(0.3, torch.linspace(0, 1.0, M + 1, dtype=torch.float64))
    rows = []
    for i in range(IDS.shape[0]):
        model.zero_grad()
        models.user_losses(model(IDS[i:i + 1]), IDS[i:i + 1], TARGETS[i:i + 1]).sum().backward()
        rows.append(torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
                               for p in model.parameters()]))
    model.zero_grad()
    ref = torch.stack(rows).norm(dim=1)
    _, norms = PhantomClipping(model, C=1.0).per_example_norms(clipping.user_losses, (IDS, TARGETS))
    sq = norms ** 2
    assert ref.min() > 0
    torch.testing.assert_close(sq.sqrt(), ref, rtol=1e-5, atol=0)
    # the correction moved the model (else the test would not tell)
    vanilla = build(False).train()
    vanilla.load_state_dict(model.state_dict())
    assert not torch.allclose(vanilla(IDS), model(IDS))


TINY = ["experiment=dpformer_ci", "model=dpformer", "dataset.n_users=80", "dataset.L=10", "seqrec.batch_size=40"]


@pytest.mark.slow
def test_bad_reattention_settings_are_refused_naming_the_key(cfg_for):
    from pipeline import tasks
    from pipeline.validation import ConfigError

    tasks.validate(cfg_for(*TINY))
    tasks.validate(cfg_for(*TINY, "model.reattention.presence=private"))
    for override, needle in (("model.reattention.presence=nosuch", r"model\.reattention\.presence"),
                             ("model.reattention.eps_share=0", r"model\.reattention\.eps_share"),
                             ("model.reattention.eps_share=1", r"model\.reattention\.eps_share"),
                             ("model.arch=gru", r"model\.reattention"),
                             ("model.reattention.form=nosuch", r"model\.reattention\.form"),
                             ("model.reattention.draws=2", r"model\.reattention\.draws"),
                             ("model.reattention.draws=2.5", r"model\.reattention\.draws"),
                             ("model.reattention.blocks=[3]", r"model\.reattention\.blocks"),
                             ("model.reattention.blocks=[0]", r"model\.reattention\.blocks"),
                             ("model.reattention.blocks=2", r"model\.reattention\.blocks")):
        with pytest.raises(ConfigError, match=needle):
            tasks.validate(cfg_for(*TINY, "model.reattention.presence=private", override))


@pytest.mark.slow
def test_private_presence_noise_and_budget_split(cfg_for):
    from pipeline import privacy
    from pipeline.seqrec import train

    # the counts' noise: std z sqrt(min(L + 1, M)), the floor applied after
    rows = ROWS.repeat(200, 1)  # 1000 users
    exact = ra.item_presence(rows, M) * rows.shape[0]
    g = torch.Generator().manual_seed(9)
    noisy = torch.stack([ra.item_presence(rows, M, 3.0, g) for _ in range(400)]) * rows.shape[0]
    diff = (noisy - exact)[:, 1:]
    assert diff.std().item() == pytest.approx(3.0 * math.sqrt(M), rel=0.05)
    assert abs(diff.mean().item()) < 0.2
    # the plan: histogram at (share eps, share delta), DP-SGD at the rest, spent = the sum <= eps
    public = train.plan(cfg_for(*TINY, "model=dpformer_public"), 80)
    private = train.plan(cfg_for(*TINY, "model.reattention.presence=private", "model.reattention.eps_share=0.1"), 80)
    assert public.presence_multiplier == 0 and private.presence_multiplier > 0
    assert private.presence_multiplier == pytest.approx(privacy.gaussian_multiplier(eps=0.8, delta=1e-6))
    assert private.sigma > public.sigma and private.eps_spent <= 8.0 + 1e-9
    alone = privacy.dpsgd_spent_epsilon(sigma=private.sigma, delta=0.9e-5, sample_rate=private.sample_rate,
                                        steps=private.steps, accountant="rdp")
    assert private.eps_spent == pytest.approx(alone + 0.8) and 7.1 < alone <= 7.2 + 1e-9


@pytest.mark.slow
def test_dpformer_end_to_end_one_epoch(run_cli):
    import pandas as pd

    run_cli(*TINY, "seqrec.epochs=1")
    res = pd.read_csv(run_cli.tmp / "run" / "results.csv")
    mine = res[res["method"] == "dpformer"]
    assert set(mine["split"]) == {"valid", "test"} and (mine["sigma"] > 0).all()
    assert ((0 <= mine["ndcg10"]) & (mine["ndcg10"] <= mine["hit10"]) & (mine["hit10"] <= 100)).all()


@pytest.mark.parametrize("arch", ["transformer", "gru", "propagated", "paper", "off", "sampled", "one block"])
def test_last_position_forward_is_the_full_forwards_last_row(arch):
    # evaluation ranks the last position's scores only (model(ids, last=True)): the last block attends from
    # that position alone; every block before it, and its keys and values, run in full
    if arch in ("transformer", "gru"):
        torch.manual_seed(3)
        cfg = dict(arch=arch, d=8, heads=1, blocks=2, d_ff=16, dropout=0.0, tied=True, init_std=0.3, layers=1)
        model = train.build(OmegaConf.create(cfg), M, L).double().eval()
    else:
        model = build(blocks=1 if arch == "one block" else 2, seed=3).eval()
        model.form = "propagated" if arch == "one block" else arch
        model.set_errors(0.05, torch.full((M + 1,), 0.2))
    full = model(IDS)
    last = model(IDS, last=True)
    assert last.shape == (IDS.shape[0], 1, M)
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-12, atol=1e-12)
    if arch != "gru":  # the last block's record is its last query's: the full forward's last row
        whole, one = [], []
        model(IDS, record=whole)
        model(IDS, record=one, last=True)
        torch.testing.assert_close(one[-1]["att"], whole[-1]["att"][:, :, -1:], rtol=1e-12, atol=1e-12)
