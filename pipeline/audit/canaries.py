"""White-box canaries for auditing a whole DP-SGD training in one run (Steinke, Nasr and
Jagielski 2023, Section 6: "Dirac canaries"; scored with ``pipeline.one_run.one_run_bound``).

Each of the m canaries is one coordinate of the model's trainable parameters (distinct, drawn by a
seeded permutation of every coordinate); its gradient is C times that basis vector: norm exactly
C, so it is a valid example whatever the clipping does, and the accountant's guarantee covers it
like any other example. Each canary is *included* in the training data with probability 1/2
(``seed``'s bits, kept in this object and read only by ``reveal`` after training). An included
canary is in each step's Poisson sample independently with the training's sampling rate (its own
generator: the data's sampling and noise are drawn as without canaries); when sampled, C is added
to its coordinate of the clipped sum, before the noise (``add``).

The score of a canary (``observe`` after every step's noise, ``scores`` after training) is its
coordinate of the sum over the run of the noisy clipped sums: the released transcript of DP-SGD
(every noisy sum; the model is post-processing of it), so a bound computed from it bounds the
training's eps. Included canaries' scores have mean C times the number of steps that sampled them;
the noise sums to N(0, T sigma^2 C^2) on each coordinate. The sum is the natural statistic when the
sampling is unknown; it cannot see a defect that only a cleverer statistic would (noise reused in a
later step cancels in a difference, not in the sum).

Beside it, each step's observations are scored by their **log-likelihood ratio** (``llr_scores``):
at step t a canary's coordinate y of the noisy sum is, excluded, N(mu_t, v_t) (the noise and the
data's gradients on the canaries' coordinates) and, included, the same plus C with probability q
(the Poisson-subsampled Gaussian mechanism actually run), so

    log [(1 - q) N(y; mu_t, v_t) + q N(y; mu_t + C, v_t)] / N(y; mu_t, v_t)
        = log(1 - q + q exp((C (y - mu_t) - C^2 / 2) / v_t)),

summed over the steps. mu_t and v_t are read from that step's m observations without the inclusion
bits (which stay secret until scoring): their mean and variance less what the canaries themselves
add (half of them included, each sampled with probability q: mean q C / 2, variance q C^2 / 2 -
(q C / 2)^2), v_t floored at a millionth of C^2. Where the noise is small against C (a small
multiplier, a run that under-noises) the ratio keeps what the sum throws away: a step that did
not sample a canary adds nothing but noise to its sum, and about nothing to its ratio.
"""

from __future__ import annotations

import math

import numpy as np
import torch


class DiracCanaries:
    def __init__(self, params: list[torch.nn.Parameter], *, m: int, C: float, sample_rate: float, seed: int):
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        if not 0 < m <= total:
            raise ValueError(f"m = {m} canaries need as many parameter coordinates; the model has {total}")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"the sampling rate must lie in (0, 1], got {sample_rate}")
        rng = np.random.default_rng(seed)
        flat = rng.choice(total, size=m, replace=False)
        self._included = rng.random(m) < 0.5  # secret until reveal()
        offsets = np.cumsum([0] + sizes)
        which = np.searchsorted(offsets, flat, side="right") - 1
        self.params, self.C, self.q, self.m, self.seed = params, float(C), float(sample_rate), m, int(seed)
        # per parameter holding canaries: (their flat indices in it, their canary numbers)
        self._by_param: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
        for w in np.unique(which):
            js = np.flatnonzero(which == w)
            self._by_param[int(w)] = (torch.from_numpy(flat[js] - offsets[w]), js)
        self._gen = torch.Generator().manual_seed(seed + 7919)
        self._sums = np.zeros(m)
        self._llr = np.zeros(m)  # each canary's per-step log-likelihood ratios, summed
        self.moments: list[tuple[float, float]] = []  # each step's (mu_t, v_t), read without the bits
        self.sampled = np.zeros(m, dtype=np.int64)  # times each canary was in a step's sample (0 if excluded)

    def add(self) -> None:
        """Each included canary in this step's sample with probability q: C added to its coordinate
        of every ``p.grad`` (the clipped sum, before the noise)."""
        draw = (torch.rand(self.m, generator=self._gen) < self.q).numpy() & self._included
        self.sampled += draw
        for w, (ix, js) in self._by_param.items():
            hit = draw[js]
            if hit.any():
                grad = self.params[w].grad.view(-1)
                grad.index_add_(0, ix[hit].to(grad.device), torch.full((int(hit.sum()),), self.C, dtype=grad.dtype,
                                                                        device=grad.device))

    def observe(self) -> None:
        """After the noise: each canary's coordinate of the noisy sum, added to its sum score and
        scored by its log-likelihood ratio for this step (the module's docstring)."""
        y = np.empty(self.m)
        for w, (ix, js) in self._by_param.items():
            y[js] = self.params[w].grad.detach().view(-1)[ix.to(self.params[w].grad.device)].double().cpu().numpy()
        self._sums += y
        mu, v = step_moments(y, q=self.q, C=self.C)
        self._llr += step_llr(y, mu=mu, v=v, q=self.q, C=self.C)
        self.moments.append((mu, v))

    def state(self) -> dict:
        """What a checkpoint keeps (``load_state`` restores it): the sums so far, the sampling
        counts and the canaries' generator; not the inclusion bits, which the seed redraws."""
        return {"sums": torch.from_numpy(self._sums.copy()), "sampled": torch.from_numpy(self.sampled.copy()),
                "llr": torch.from_numpy(self._llr.copy()), "moments": torch.tensor(self.moments, dtype=torch.float64),
                "generator": self._gen.get_state(), "seed": torch.tensor(self.seed)}  # tensors: read with weights_only

    def load_state(self, state: dict) -> None:
        if tuple(state["sums"].shape) != self._sums.shape:
            raise ValueError(f"a checkpoint of {state['sums'].numel()} canaries cannot resume an audit of {self.m}")
        if "seed" not in state or int(state["seed"]) != self.seed:  # other coordinates and other bits
            raise ValueError(f"a checkpoint of canaries drawn with seed {int(state['seed']) if 'seed' in state else '?'} "
                             f"cannot resume an audit whose canaries are drawn with seed {self.seed}")
        self._sums, self.sampled = state["sums"].numpy().copy(), state["sampled"].numpy().copy()
        self._llr = state["llr"].numpy().copy()
        self.moments = [tuple(row) for row in state["moments"].tolist()]
        self._gen.set_state(state["generator"])

    def scores(self) -> np.ndarray:
        """Each canary's score in units of C (the sum of its noisy coordinates / C)."""
        return self._sums / self.C

    def llr_scores(self) -> np.ndarray:
        """Each canary's per-step log-likelihood ratios, summed (the module's docstring)."""
        return self._llr.copy()

    def steps(self) -> int:
        return len(self.moments)

    def reveal(self) -> np.ndarray:
        """The inclusion bits: for scoring, after training."""
        return self._included.copy()


def step_moments(y: np.ndarray, *, q: float, C: float) -> tuple[float, float]:
    """(mu_t, v_t): the mean and variance of an excluded canary's observation at one step, from all m
    observations ``y`` without the inclusion bits: their mean less q C / 2 and their variance less
    q C^2 / 2 - (q C / 2)^2 (what half the canaries, each sampled with probability q, add), the
    variance floored at C^2 / 10^6."""
    add = q * C / 2
    var = float(np.var(y)) - (q * C * C / 2 - add * add)
    return float(np.mean(y)) - add, max(var, C * C * 1e-6)


def step_llr(y: np.ndarray, *, mu: float, v: float, q: float, C: float) -> np.ndarray:
    """log(1 - q + q exp((C (y - mu) - C^2 / 2) / v)) for each observation: the log-likelihood ratio of
    "included" (C added with probability q) against "excluded", with N(mu, v) the excluded law."""
    z = (C * (np.asarray(y, dtype=np.float64) - mu) - C * C / 2) / v
    if q >= 1:
        return z
    return np.logaddexp(math.log1p(-q), math.log(q) + z)
