"""Re-Attention (section 5, appendices C-D of the DPFormer paper): debias attention scores for
the noise DP-SGD leaves in the parameters.

1. Effective error (Eq. 5.3 with appendix C's typo correction, Claims 5.3-5.4): the noise std of one
   DP-SGD gradient coordinate, sigma_dp C / B (C the clipping norm; the paper normalises C = 1), for
   every weight inside the blocks (and, a choice, the position table), and sigma_dp C / (B p_i) for
   item row i, p_i the probability that item i appears in a user's training sequence. p_i is public
   (Remark C.1), counted on the training rows and floored at one user (an item no training user
   has would otherwise get an infinite error). ``presence: private`` releases the per-item user
   counts with Gaussian noise instead: a user adds at most k = min(L + 1, M) distinct items, so
   the count vector has L2 sensitivity sqrt(k) (add/remove one user, DP-SGD's relation); its
   noise multiplier is the analytic Gaussian one for a share of (eps, delta), DP-SGD is
   calibrated to the rest, and the two compose by basic composition (``train.plan``).
2. Error propagation (section 5.2.2, appendix D): means are the forward activations of the noisy
   model (the noisy parameter as the estimate of its mean), variances are propagated per token and
   coordinate under independence: linear layers by Eq. 5.5 summed over fan-in, ReLU by the
   corrected Eq. 5.6 (``relu_moments``), GELU by its exact moments (``gelu_moments``).
   Choices for what the paper leaves out: residual connections add variances; LayerNorm by the
   delta method with the token's mean and scale as functions of its noisy input, around the
   scale the noisy token is expected to have (``layer_norm_var``; an earlier release took them as
   constants, which over-estimated block 2's variances up to 1,200-fold at the full Amazon data's
   errors), and means propagated beside the variances from there on (``DPFormer._block``); the
   attention output sum_i a_i V_i treats the (corrected) weights a_i as constants (variance
   sum_i a_i^2 Var V_i); dropout is ignored. These per-coordinate variances feed the next block's
   values and LayerNorms; its *keys* are read along one direction per query, where the covariance
   between coordinates (which they drop) adds up: a later block's key variance is instead pulled
   back along that direction through the block before (``keyvar.Pullback``: the same moments, the
   covariances of W_v, W_o, the feed-forward and both LayerNorms included; exact against autograd
   in the delta method's limit). On a trained model the per-coordinate rule put block 2's logit
   variances at 0.16-0.27 of Monte Carlo at the median (issue 41); pulled back, 0.96-1.25
   (``benchmarks/reattention_mc.py``). Every block's logit variances are checked against Monte Carlo
   over noisy parameters (``pipeline/seqrec/perturb.py``, ``tests/test_seqrec_reattention.py``).
3. Correction (Eq. 5.2): with the query q fixed, the logit <q, K_i> / sqrt(d_h) has variance
   Var_i, and E[exp] = exp(mean) exp(Var_i / 2); S_i <- S_i / exp(Var_i / 2), then renormalise
   (done as logits - Var_i / 2 before the softmax). The paper's Var_i = C sigma_i^2 with
   C = <q, q> takes the key's coordinates independent; here Var_i is the linear rule applied to
   the logit itself (x_i -> x_i . W_k^T q), exact for a Gaussian input with independent
   coordinates: it is C sigma_i^2 plus the covariance the input's noise induces between key
   coordinates. Computed without gradient, from the noise scale and public statistics only:
   no privacy cost, and Phantom Clipping's per-user norms stay exact (the correction is a
   constant of the backward pass).
4. The errors under Adam (``model.reattention.errors: adam``, an ablation; ``adam_errors``). The
   paper's errors are the std of one DP-SGD gradient coordinate; the trainings here (and the
   paper's) take Adam steps, whose per-coordinate scaling changes what the noise leaves in the
   parameters. Where a coordinate's gradient is dominated by the DP noise (std s = sigma C / B),
   Adam's second moment is about s^2, so the step lr_t m_hat_t / sqrt(v_hat_t) carries the noise
   xi_k / s ~ N(0, 1) of every earlier step k with weight a_t beta1^(t-k), a_t = lr_t (1 - beta1)
   / (1 - beta1^t). The parameter's deviation from the noise-free trajectory after t steps is
   sum_k c_k(t) xi_k / s, c_k(t) = sum_{j=k..t} a_j beta1^(j-k): its std,
   e_t = sqrt(sum_k c_k(t)^2), depends on the learning-rate schedule and beta1 only, not on sigma,
   C, B or p_i (computed in O(T) by a recursion). The same e_t is used for every parameter, block
   weight and item row alike, and at step t the model corrects for e_(t-1), the noise its present
   parameters carry (0 at the first step; e_T for evaluation). Checked against Adam run on pure
   noise (to 3%) and against the spread between trainings that differ only in their DP noise
   draws (``tests/test_seqrec_adam_errors.py``, the CI data, 40 steps: block weights 0.99 e_T and
   tail items 0.96-0.98 e_T at eps 1 and at eps 8, whose noise multipliers differ 5-fold; head
   items, whose gradients carry signal, 0.87-0.96 e_T). It needs no item presence, so no
   histogram is released and no eps is spent on it.

5. The sampled variances (``model.reattention.form: sampled``). Where the item errors are as large as the
   full Amazon data's at eps 5 (6 to 45, the tail's rows far noisier than the embeddings), every block-1
   token is mostly noise and two things the propagation's delta method cannot carry decide block 2's key
   variance: block 1's attention weights, random there (each noisy model's correction is itself computed
   from its noisy activations), and block 1's output scale. Propagated, block 2's logit variances keep
   the right median but their lower tail falls far below Monte Carlo, and linearising the whole network
   around the clean model is orders of magnitude off instead (docs/dpformer.md gives the figures,
   ``benchmarks/reattention_mc.py`` the table's). ``sampled`` estimates each block's logit variances by Monte Carlo, beside
   the model: S = ``draws`` noisy copies of the parameters (the noise model of 1. or 4.: the whole item
   table, the positions, every block weight) run through the blocks with the model, block by block; at
   each block the variance over the copies of <q_t, k_s> / sqrt(d_h), q_t the model's query and k_s the
   copies' keys, is the correction, and each copy corrects its own attention as a noisy model would: by
   the variance of its own query against the other copies' keys (``_own_variances``; with the model's
   correction instead, block 2 came out well above Monte Carlo: docs/dpformer.md). Checked against Monte Carlo over noisy sampled models on trained models
   (``benchmarks/reattention_mc.py``, ``tests/test_seqrec_reattention.py``). The copies' noise is a
   function of (the seed the model was built under, the training step) alone, drawn for the whole
   table: a user's correction does not depend on the other users of its batch (Phantom Clipping's
   per-user norms stay exact), the engine's brute force (check="brute") and evaluation's chunks see the batch's draws,
   and a resumed training draws what the uninterrupted one drew. Cost per forward pass, without
   gradient: S copies of the blocks' forward (S x the activations' memory), S draws of the item table
   (S (M + 1) d normal numbers), and S^2 n h T^2 d_h for the copies' own variances; the estimate of a
   logit's variance has a relative sd of about sqrt(2 / (S - 1)) for a Gaussian logit (18% at the default
   S = 64), more where the noise makes the logits heavy-tailed (why the default is 64: docs/dpformer.md).

Corrections to the paper's printed formulas: Eq. 5.6 subtracts c^2 where it must subtract
E[Y]^2 (as printed it gives 0.5 for a standard normal input, the right value 0.3408 is Table 3's
analytic column); zeta in the max approximation of Eq. 5.2 is the Gumbel mean, Euler-Mascheroni's
0.5772, not pi^2/6 (the Gumbel variance). zeta cancels in the renormalisation, so it does not enter
the computation.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from pipeline import rng
from pipeline.seqrec.keyvar import Pullback
from pipeline.seqrec.models import Transformer, at_last

FORMS = ("propagated", "sampled", "paper", "off")  # model.reattention.form: the logit variance the correction uses
ERRORS = ("paper", "adam")  # model.reattention.errors: the parameters' noise the correction assumes (1. or 4. above)
EULER_GAMMA = 0.5772156649015329  # zeta of Eq. 5.2: the mean of a standard Gumbel (the paper prints pi^2/6)


def _phi(z):
    return torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _Phi(z):
    return 0.5 * (1 + torch.erf(z / math.sqrt(2)))


def relu_moments(mu: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of ReLU(X), X ~ N(mu, var) (Lemma D.2 with X_2 = 0): with s = sqrt(var),
    z = mu / s, E[Y] = mu Phi(z) + s phi(z), E[Y^2] = (mu^2 + var) Phi(z) + mu s phi(z), and
    Var[Y] = E[Y^2] - E[Y]^2 (the printed Eq. 5.6 subtracts mu^2: wrong). var = 0 gives
    (ReLU(mu), 0)."""
    s = var.clamp(min=0).sqrt()
    z = mu / s.clamp(min=torch.finfo(mu.dtype).tiny)
    pdf, cdf = _phi(z), _Phi(z)
    mean = mu * cdf + s * pdf
    second = (mu * mu + var) * cdf + mu * s * pdf
    zero = s == 0
    mean = torch.where(zero, mu.clamp(min=0), mean)
    return mean, torch.where(zero, torch.zeros_like(var), (second - mean * mean).clamp(min=0))


def relu_slope(mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """E[ReLU'(X)] = P(X > 0) = Phi(mu / s), X ~ N(mu, var): by Stein's lemma Cov(ReLU(X), X) = this
    times Var X, the slope of ReLU's linear part (``keyvar``). var = 0 gives the step 1[mu > 0]."""
    s = var.clamp(min=0).sqrt()
    return torch.where(s == 0, (mu > 0).to(mu.dtype), _Phi(mu / s.clamp(min=torch.finfo(mu.dtype).tiny)))


_HERMITE = np.polynomial.hermite_e.hermegauss(64)  # probabilists' Gauss-Hermite: E f(Z), Z ~ N(0, 1)


def gelu_moments(mu: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of GELU(X) = X Phi(X), X ~ N(mu, var). E[Y] is closed form,
    mu Phi(mu / r) + var phi(mu / r) / r with r = sqrt(1 + var); E[Y^2] has none (a bivariate
    normal CDF), so both moments come from 64-node Gauss-Hermite quadrature (exact to ~1e-10 for
    the smooth GELU). The paper (Remark D.3) reuses the ReLU formula instead."""
    x, w = (torch.as_tensor(a, dtype=mu.dtype, device=mu.device) for a in _HERMITE)
    w = w / w.sum()
    y = F.gelu(mu[..., None] + var.clamp(min=0).sqrt()[..., None] * x)
    mean = (y * w).sum(-1)
    return mean, ((y - mean[..., None]) ** 2 * w).sum(-1)


def linear_var(mu_x: torch.Tensor, var_x: torch.Tensor, weight: torch.Tensor, err: float,
               has_bias: bool) -> torch.Tensor:
    """Variance of y = x W^T + b with x independent coordinates (mean mu_x, variance var_x) and
    W, b independent with means (weight, bias) and std err (Eq. 5.5 summed over fan-in):
    Var y_j = sum_k var_x,k err^2 + var_x,k W_jk^2 + err^2 mu_x,k^2 (+ err^2 for the bias)."""
    e2 = err * err
    out = var_x @ (weight * weight).T + e2 * (var_x + mu_x * mu_x).sum(-1, keepdim=True)
    return out + e2 if has_bias else out


def presence_sensitivity(rows: torch.Tensor, n_items: int) -> float:
    """L2 sensitivity of the per-item user counts to adding or removing one user: sqrt(k), k the
    most distinct items one row can hold (its length, at most n_items)."""
    return math.sqrt(min(rows.shape[1], n_items))


def item_counts(rows: torch.Tensor, n_items: int) -> torch.Tensor:
    """(n_items + 1,) long: how many users' rows hold each item (a user counts once per item); [0]
    counts the rows with padding."""
    user = torch.arange(rows.shape[0]).repeat_interleave(rows.shape[1])
    pairs = torch.unique(user * (n_items + 1) + rows.flatten())
    return torch.bincount(pairs % (n_items + 1), minlength=n_items + 1)


def item_presence(rows: torch.Tensor, n_items: int, noise_multiplier: float = 0.0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """p (n_items + 1,): p_i = (number of users whose training row holds item i) / n_users,
    floored at 1 / n_users; p_0 (padding) = 1. With ``noise_multiplier`` z > 0 the counts get
    N(0, (z sqrt(k))^2) noise first (the Gaussian mechanism, ``presence_sensitivity``); the floor
    is post-processing."""
    n = rows.shape[0]
    counts = item_counts(rows, n_items).double()
    if noise_multiplier > 0:
        std = noise_multiplier * presence_sensitivity(rows, n_items)
        counts = counts + std * torch.randn(counts.shape, generator=generator, dtype=counts.dtype)
    p = counts.clamp(min=1) / n
    p[0] = 1.0
    return p


def effective_errors(sigma_dp: float, C: float, batch_size: int, presence: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(block error sigma_dp C / B, item errors sigma_dp C / (B p_i)) (Claims 5.3-5.4, Eq. C.3);
    the padding row's error is 0 (its input is masked)."""
    block = sigma_dp * C / batch_size
    items = block / presence
    items[0] = 0.0
    return block, items


def adam_errors(lrs, beta1: float) -> np.ndarray:
    """e_t, t = 1..T: the std that DP noise leaves in a parameter after t Adam steps at learning rates
    ``lrs`` (the rate of each step, in order) with first-moment decay ``beta1``, where the gradient is
    dominated by the noise (point 4 of the module docstring). With Q_t = sum_k c_k(t) beta1^(t-k) and
    G_t = sum_(j<t) beta1^(2j): Var_t = Var_(t-1) + 2 a_t beta1 Q_(t-1) + a_t^2 G_t,
    Q_t = beta1 Q_(t-1) + a_t G_t."""
    var = q = g = 0.0
    out = np.empty(len(lrs))
    for t, lr in enumerate(lrs, 1):
        a = float(lr) * (1 - beta1) / (1 - beta1 ** t)
        g = beta1 * beta1 * g + 1.0
        var += 2 * a * beta1 * q + a * a * g
        q = beta1 * q + a * g
        out[t - 1] = math.sqrt(var)
    return out


def histogram_share(reattention_cfg) -> float:
    """The share of (eps, delta) spent on the private item histogram: ``eps_share`` where
    Re-Attention uses the paper's errors with private presence, else 0 (no histogram released)."""
    re = reattention_cfg
    if re is None or re.get("presence") != "private" or re.get("errors", "paper") != "paper":
        return 0.0
    return float(re.eps_share)


class DPFormer(Transformer):
    """The tied Transformer plus Re-Attention. The same parameters and module calls as
    ``Transformer`` (so every clipping engine walks it the same way); the variances are computed
    with plain tensor operations, under ``torch.no_grad``. With zero errors (``set_errors`` not
    called, or sigma_dp = 0) its forward is the Transformer's, bit for bit.

    Ablations (``model.reattention``): ``form`` is the logit variance the correction subtracts:
    ``propagated`` (this project's: the linear rule on the logit itself, ``logit_var``), ``sampled``
    (Monte Carlo over ``draws`` noisy copies run beside the model: point 5 above), ``paper``
    (Eq. 5.2: the key's coordinates independent, Var_i = sum_j q_j^2 Var K_ij / d_h, which is
    <q, q> sigma_i^2 / d_h when they share one variance) or ``off`` (no correction: the vanilla
    attention of a model built and calibrated the same way); ``blocks``, the blocks corrected
    (numbered from 1; None: all). Except with ``sampled`` (which propagates nothing), the variances are
    propagated through every block either way."""

    def __init__(self, n_items: int, max_len: int, *, form: str = "propagated", corrected=None, draws: int = 64,
                 **kw):
        super().__init__(n_items, max_len, **kw)
        if form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, got {form!r}")
        if int(draws) < 3:
            raise ValueError(f"draws must be at least 3 (each draw's variance is over the others), got {draws!r}")
        self.form = form
        self.draws = int(draws)
        # form=sampled: the draws' stream is a function of (seed, step) alone, not of the batch or of how many
        # forward passes ran (the engine's brute force and evaluation chunks see the draws the batch saw): the
        # seed torch was seeded with when the model was built (no draw from its stream), the step set by the
        # training loop (``at_step``; a resumed training sets the step it resumes at)
        self.sample_seed = torch.initial_seed() % 2**31
        self.sample_step = 0
        self.corrected = None if corrected is None else frozenset(int(b) for b in corrected)
        self.block_err = 0.0
        self.register_buffer("item_err", torch.zeros(n_items + 1), persistent=False)

    # a later block's key variance pulled back through the block before (``keyvar``); False: from the
    # per-coordinate variances alone (earlier releases' rule, which drops the covariances: for
    # benchmarks/reattention_mc.py's comparison, not a setting)
    pull_keys = True

    def set_errors(self, block: float, items: torch.Tensor) -> None:
        self.block_err = float(block)
        self.item_err = items.to(self.item_err)

    def at_step(self, step: int) -> None:
        """The training step whose noise draws ``form=sampled`` uses (every forward until the next call)."""
        self.sample_step = int(step)

    def set_uniform_errors(self, err: float) -> None:
        """One error for every parameter, block weights and item rows alike (``errors: adam``); the
        padding row none."""
        self.block_err = float(err)
        self.item_err.fill_(float(err))
        self.item_err[0] = 0.0

    @property
    def active(self) -> bool:
        return self.block_err > 0 or bool((self.item_err > 0).any())

    def forward(self, ids: torch.Tensor, *, record: list | None = None, last: bool = False) -> torch.Tensor:
        """Scores (n, T, M); ``record``, if a list, receives per block {"var": the logit variances,
        "att": the corrected attention weights}, both (n, h, T, T), and the block's input "x" (n, T, d)
        and queries "q" (n, h, T, d_h); ``last``: as ``Transformer``'s (the last block's records are its
        last query's, (n, h, 1, .))."""
        if not self.active:
            return super().forward(ids, record=record, last=last)
        if self.form == "sampled":  # the draws run every position; the last query's rows kept
            out = self._forward_sampled(ids, record)
            if last and record:
                record[-1] = {k: v if k == "x" else v[:, :, -1:] for k, v in record[-1].items()}
            return at_last(out, last)
        x, mask, allowed = self.inputs(ids)
        with torch.no_grad():
            e2 = self.item_err.to(x.dtype)[ids] ** 2 * mask
            var = (e2 + self.block_err ** 2)[..., None].expand_as(x).clone()
            mean = x.detach()  # the first block's input is linear in the parameters: its mean is the forward's
        for number, block in enumerate(self.blocks, 1):
            final = number == len(self.blocks)
            x, mean, var = self._block(block, x, mean, var, allowed, record, number, last=last and final,
                                       propagate=not final)
        return self.scores(x)

    def logit_var(self, attn, x: torch.Tensor, var: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Var of <q_t, K_i> / sqrt(d_h) over the noise in x_i and in W_k, b_k, q fixed: (n, h, T, T)."""
        n, T, d = x.shape
        h = attn.heads
        dh = d // h
        e2 = self.block_err ** 2
        wk = attn.k.weight.view(h, dh, d)
        a = q @ wk[None]  # (n, h, T, d): W_k^T q per head
        qq = (q * q).sum(-1, keepdim=True)  # (n, h, T, 1)
        if isinstance(var, Pullback) and self.pull_keys:  # a later block's keys: along a, through the block before
            keys, var = var.quadratic(a), var.diag
        elif isinstance(var, Pullback):  # the per-coordinate rule of earlier releases (a comparison only)
            var = var.diag
            keys = (a * a) @ var[:, None].transpose(-1, -2)
        else:  # the first block's: independent coordinates (its input is the noisy tables)
            keys = (a * a) @ var[:, None].transpose(-1, -2)
        out = keys + qq * e2 * (var + x ** 2).sum(-1)[:, None, None, :]
        return (out + qq * e2) / dh

    def paper_logit_var(self, attn, x: torch.Tensor, var: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Eq. 5.2's variance: sum_j q_j^2 Var K_ij / d_h, the key's coordinates independent, each with
        its variance by the linear rule (``form=paper``): (n, h, T, T)."""
        var = var.diag if isinstance(var, Pullback) else var  # the key's coordinates independent
        var_k = attn.split(linear_var(x, var, attn.k.weight, self.block_err, True))  # (n, h, T, d_h)
        return (q * q) @ var_k.transpose(-1, -2) / q.shape[-1]

    def correction(self, attn, mean, var, q, number: int) -> torch.Tensor:
        """The logit variances of block ``number`` (the ``propagated`` form, whatever the ablation: the
        record keeps them) and the ones the correction subtracts half of (zero where it is off)."""
        lv = self.logit_var(attn, mean, var, q)
        if self.form == "off" or (self.corrected is not None and number not in self.corrected):
            return lv, torch.zeros_like(lv)
        return lv, lv if self.form == "propagated" else self.paper_logit_var(attn, mean, var, q)

    def _forward_sampled(self, ids: torch.Tensor, record: list | None) -> torch.Tensor:
        """``form=sampled``: each block's logit variances from ``draws`` noisy copies of the parameters run
        beside the model, block by block (point 5 of the module docstring)."""
        x, mask, allowed = self.inputs(ids)
        g = torch.Generator(device=ids.device)  # the step's stream (pipeline/rng.py: torch keeps 32 bits of a
        g.manual_seed(int(rng.seeds(self.sample_seed, "reattention:sampled", range(self.sample_step, self.sample_step + 1))[0]))
        # seed, so seed + step would reuse the training's other generators' seeds)
        S = self.draws
        with torch.no_grad():
            table = self.items.weight
            rows = torch.empty((S,) + ids.shape + (table.shape[1],), dtype=x.dtype, device=x.device)
            err = self.item_err.to(table)[:, None]
            for s in range(S):  # the whole table's noise, one draw at a time: what a row gets is the batch's no matter
                rows[s] = F.embedding(ids, table + err * torch.randn(table.shape, generator=g, dtype=table.dtype,
                                                                      device=table.device))
            pos = self.positions.weight
            noisy_pos = pos + self.block_err * torch.randn((S,) + pos.shape, generator=g, dtype=pos.dtype,
                                                           device=pos.device)
            T = ids.shape[1]
            xs = rows * mask[..., None] + noisy_pos[:, None, pos.shape[0] - T:]  # (S, n, T, d), dropout ignored
        for number, block in enumerate(self.blocks, 1):
            x, xs = self._block_sampled(block, x, xs, allowed, record, number, g)
        return self.scores(x)

    def _noisy(self, module, g: torch.Generator) -> dict:
        """The draws' copies of ``module``'s parameters: {name: (draws, *shape)}, each N(0, block_err^2) off."""
        return {name: p.detach() + self.block_err * torch.randn((self.draws,) + p.shape, generator=g, dtype=p.dtype,
                                                                device=p.device)
                for name, p in module.named_parameters(recurse=False)}

    def _block_sampled(self, block, x, xs, allowed, record, number: int, g: torch.Generator):
        """One block of ``form=sampled``: the model's forward (as ``_block``'s) with the correction the draws
        give (its query against the draws' keys), and the draws' own forward through their noisy copies of
        the block, each draw's attention corrected by its own query against the other draws' keys
        (``_own_variances``), as a noisy model's would be: (output, the draws' outputs (draws, n, T, d))."""
        attn = block.attn
        q, v, scores = attn.logits(x)
        with torch.no_grad():
            p = {name: self._noisy(m, g) for name, m in (("q", attn.q), ("k", attn.k), ("v", attn.v),
                                                          ("out", attn.out), ("ln1", block.ln1), ("ln2", block.ln2),
                                                          ("ff1", block.ff1), ("ff2", block.ff2))}

            def lin(h, name):
                return torch.einsum("s...i,soi->s...o", h, p[name]["weight"]) + p[name]["bias"][:, None, None]

            def split(h):  # (S, n, T, d) -> (S, n, heads, T, d / heads)
                return h.unflatten(-1, (attn.heads, -1)).transpose(-2, -3)

            qs, ks, vs = split(lin(xs, "q")), split(lin(xs, "k")), split(lin(xs, "v"))
            dh = q.shape[-1]
            lv = (q.detach() @ ks.transpose(-1, -2) / math.sqrt(dh)).var(0)  # the model's query, the draws' keys
            used = torch.zeros_like(lv) if self.corrected is not None and number not in self.corrected else lv
        out, att = self._attend(block, x, v, scores, used, allowed)
        if record is not None:
            record.append({"var": lv, "used": used, "att": att, "x": x.detach(), "q": q.detach()})
        with torch.no_grad():
            own = _own_variances(qs, ks) if used.any() else used  # each draw's correction, as a noisy model makes it
            ss = (qs @ ks.transpose(-1, -2) / math.sqrt(dh) - own / 2).masked_fill(~allowed[:, None], float("-inf"))
            ys = (torch.softmax(ss, dim=-1) @ vs).transpose(-2, -3).flatten(-2)  # merged heads (S, n, T, d)

            def norm(h, name, eps):
                h = (h - h.mean(-1, keepdim=True)) / (h.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
                return h * p[name]["weight"][:, None, None] + p[name]["bias"][:, None, None]

            x1 = norm(xs + lin(ys, "out"), "ln1", block.ln1.eps)
            xs = norm(x1 + lin(F.relu(lin(x1, "ff1")), "ff2"), "ln2", block.ln2.eps)
        return out, xs

    def _attend(self, block, x, v, scores, used, allowed):
        """The block's forward from its scores on: the correction ``used`` (half of it subtracted from the
        logits), the masked softmax, dropout, W_o, the residuals, both LayerNorms and the feed-forward:
        (output, the attention weights before dropout, detached). ``x``: the residual stream at the
        scores' query positions."""
        attn = block.attn
        scores = (scores - used / 2).masked_fill(~allowed[:, None], float("-inf"))
        att = torch.softmax(scores, dim=-1)
        a = att.detach()
        att = attn.drop(att)
        x1 = block.ln1(x + block.drop(attn.out(attn.merge(att @ v))))
        return block.ln2(x1 + block.drop(block.ff2(block.drop(F.relu(block.ff1(x1)))))), a

    def _block(self, block, x, mean, var, allowed, record, number: int = 1, *, last: bool = False,
               propagate: bool = True):
        """One block's forward (the model's computation, Re-Attention's correction in its attention)
        and the moments of its output under the parameters' noise: (output, mean, variance). ``last``:
        the last position's query alone (its output (n, 1, d)); ``propagate=False`` (the last block,
        whose output's moments no block reads): the moments are not computed (None, None).

        The moments are propagated from the block input's (``mean``, ``var``) with plain tensor
        operations (no module call, so no engine hook sees them), dropout ignored, the attention
        weights the corrected ones of the forward. Means matter after a LayerNorm: where the noise
        is comparable to a token's scale, the noisy tokens' mean is shrunk towards zero
        (``layer_norm_moments``) and is no longer the forward's activation."""
        attn, err = block.attn, self.block_err
        q, v, scores = attn.logits(x, last)
        pull, var = var, var.diag if isinstance(var, Pullback) else var
        with torch.no_grad():
            lv, used = self.correction(attn, mean, pull, q.detach(), number)
        out, a = self._attend(block, at_last(x, last), v, scores, used, at_last(allowed, last))
        if record is not None:
            record.append({"var": lv, "used": used, "att": a, "x": x.detach(), "q": q.detach()})
        if not propagate:
            return out, None, None
        if last:
            raise ValueError("last=True reads one position: no block after it can use its moments")
        with torch.no_grad():
            mean_v = F.linear(mean, attn.v.weight, attn.v.bias)
            var_v = attn.split(linear_var(mean, var, attn.v.weight, err, True))
            mean_y = attn.merge(a @ attn.split(mean_v))
            var_y = attn.merge((a ** 2) @ var_v)
            mean_r = mean + F.linear(mean_y, attn.out.weight, attn.out.bias)
            var_r = var + linear_var(mean_y, var_y, attn.out.weight, err, True)
            x1, var_xhat1 = normalised_moments(mean_r, var_r, block.ln1.eps)
            mean_1, var_1 = layer_norm_output(block.ln1, x1, var_xhat1, err)
            mean_pre = F.linear(mean_1, block.ff1.weight, block.ff1.bias)
            var_pre = linear_var(mean_1, var_1, block.ff1.weight, err, True)
            mean_act, var_act = relu_moments(mean_pre, var_pre)
            mean_r2 = mean_1 + F.linear(mean_act, block.ff2.weight, block.ff2.bias)
            var_r2 = var_1 + linear_var(mean_act, var_act, block.ff2.weight, err, True)
            x2, var_xhat2 = normalised_moments(mean_r2, var_r2, block.ln2.eps)
            mean_out, var_out = layer_norm_output(block.ln2, x2, var_xhat2, err)
            slope = relu_slope(mean_pre, var_pre)
            pull = Pullback(block, err, mean, var, a, mean_y, var_y, x1, expected_scale(mean_r, var_r, block.ln1.eps),
                            var_xhat1, mean_1, var_1, slope, (var_act - slope * slope * var_pre).clamp(min=0), mean_act,
                            var_act, x2, expected_scale(mean_r2, var_r2, block.ln2.eps), var_xhat2, var_out)
        return out, mean_out, pull


def _own_variances(qs: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """For each draw i, the variance over the other draws r != i of the logits <q_i,t, k_r,s> / sqrt(d_h): the
    correction draw i applies, its own query against keys whose noise is that of its own parameters' draws
    (``form=sampled``). qs, ks (S, n, h, T, d_h) -> (S, n, h, T, T); S^2 n h T^2 d_h operations, one draw's
    (S, n, h, T, T) logits held at a time."""
    S = qs.shape[0]
    out = torch.empty(qs.shape[:-1] + (ks.shape[-2],), dtype=qs.dtype, device=qs.device)
    for i in range(S):  # centred on the mean of all S (no cancellation): with D_r = l_r - mean, the others'
        # sum of D is -D_i, so their unbiased variance is (sum_r D_r^2 - D_i^2 S / (S - 1)) / (S - 2)
        dev = qs[i] @ ks.transpose(-1, -2) / math.sqrt(qs.shape[-1])
        dev = dev - dev.mean(0)
        out[i] = ((dev * dev).sum(0) - dev[i] * dev[i] * (S / (S - 1))) / (S - 2)
    return out


def normalised_moments(r: torch.Tensor, var_r: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of x_hat = (r' - m(r')) / s(r'), s^2 = the token's variance + eps, for a noisy
    token r' (..., d) of mean r and independent coordinates of variance var_r, by the delta method in
    which the mean m and the scale s are functions of the noisy token (they move with the noise;
    taking them as constants divides the noise by the noiseless scale alone, which can be tiny:
    0.0065 was seen).

    The Jacobian is J_jk = (delta_jk - 1/d - x_j x_k / d) / s, so with v = var_r, a_j = (1 + x_j^2) / d
    and S_p = sum_k v_k x_k^p,

        Var x_hat_j ~ sum_k J_jk^2 v_k = [v_j (1 - 2 a_j) + (S_0 + 2 x_j S_1 + x_j^2 S_2) / d^2] / s^2.

    It is taken around the scale the noisy token is expected to have, s^2 = Var_pop(r) + eps +
    (1 - 1/d) mean(v) (E of the noisy token's variance), not the noiseless one: where the noise
    dominates the token, x_hat is the normalised noise, of variance about 1, and the plain delta
    method would divide by the small noiseless scale. The mean is (r - m(r)) / s at that scale:
    shrunk towards 0 as the noise grows. Finally |x_hat_j| <= sqrt(d - 1) for any input, so no
    variance exceeds d - 1. Checked against Monte Carlo from noise 1/100 of the token's scale to 60
    times it (``tests/test_seqrec_reattention.py``)."""
    d = r.shape[-1]
    s2 = expected_scale(r, var_r, eps)
    x = (r - r.mean(-1, keepdim=True)) / s2.sqrt()
    a = (1 + x * x) / d
    S0 = var_r.sum(-1, keepdim=True)
    S1 = (var_r * x).sum(-1, keepdim=True)
    S2 = (var_r * x * x).sum(-1, keepdim=True)
    var = (var_r * (1 - 2 * a) + (S0 + 2 * x * S1 + x * x * S2) / d**2) / s2
    return x, var.clamp(min=0, max=d - 1)


def expected_scale(r: torch.Tensor, var_r: torch.Tensor, eps: float) -> torch.Tensor:
    """s^2 = Var_pop(r) + eps + (1 - 1/d) mean(v): the expected squared scale of a noisy token (..., 1)."""
    return r.var(-1, unbiased=False, keepdim=True) + eps + (1 - 1 / r.shape[-1]) * var_r.mean(-1, keepdim=True)


def layer_norm_output(ln, mean_xhat: torch.Tensor, var_xhat: torch.Tensor, err: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm's output moments from x_hat's (``layer_norm_moments``)."""
    e2 = err * err
    mean = mean_xhat * ln.weight + ln.bias
    return mean, var_xhat * (ln.weight ** 2 + e2) + e2 * mean_xhat ** 2 + e2


def layer_norm_moments(ln, r: torch.Tensor, var_r: torch.Tensor, err: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of LayerNorm's output y = x_hat gamma + beta for a noisy input of mean r
    and variance var_r (``normalised_moments`` for x_hat), gamma and beta noisy at the block error:
    Var y = (gamma^2 + err^2) Var x_hat + err^2 E[x_hat]^2 + err^2 (independent factors)."""
    return layer_norm_output(ln, *normalised_moments(r, var_r, ln.eps), err)


def calibrate(model, rows: torch.Tensor, *, sigma_dp: float, C: float, batch_size: int,
              presence_multiplier: float = 0.0, generator: torch.Generator | None = None) -> tuple[float, torch.Tensor]:
    """Set the model's effective errors from the run's noise multiplier and the item presence on
    the training rows (public, or noised with ``presence_multiplier``); return (block error, item errors)."""
    if sigma_dp == 0:  # no DP noise: nothing to correct, and no histogram is released
        presence = torch.ones(model.item_err.numel(), dtype=torch.float64)
    else:
        presence = item_presence(rows, model.item_err.numel() - 1, presence_multiplier, generator)
    block, items = effective_errors(sigma_dp, C, batch_size, presence)
    model.set_errors(block, items)
    return block, items
