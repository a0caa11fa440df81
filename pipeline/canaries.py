"""White-box canaries for auditing a whole DP-SGD training in one run (Steinke, Nasr and
Jagielski 2023, Section 6: "Dirac canaries"; scored with ``pipeline.auditing.one_run_bound``).

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
"""

from __future__ import annotations

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
        """After the noise: add each canary's coordinate of the noisy sum to its score."""
        for w, (ix, js) in self._by_param.items():
            self._sums[js] += self.params[w].grad.detach().view(-1)[ix.to(self.params[w].grad.device)].double().cpu().numpy()

    def state(self) -> dict:
        """What a checkpoint keeps (``load_state`` restores it): the sums so far, the sampling
        counts and the canaries' generator; not the inclusion bits, which the seed redraws."""
        return {"sums": torch.from_numpy(self._sums.copy()), "sampled": torch.from_numpy(self.sampled.copy()),
                "generator": self._gen.get_state(), "seed": torch.tensor(self.seed)}  # tensors: read with weights_only

    def load_state(self, state: dict) -> None:
        if tuple(state["sums"].shape) != self._sums.shape:
            raise ValueError(f"a checkpoint of {state['sums'].numel()} canaries cannot resume an audit of {self.m}")
        if "seed" not in state or int(state["seed"]) != self.seed:  # other coordinates and other bits
            raise ValueError(f"a checkpoint of canaries drawn with seed {int(state['seed']) if 'seed' in state else '?'} "
                             f"cannot resume an audit whose canaries are drawn with seed {self.seed}")
        self._sums, self.sampled = state["sums"].numpy().copy(), state["sampled"].numpy().copy()
        self._gen.set_state(state["generator"])

    def scores(self) -> np.ndarray:
        """Each canary's score in units of C (the sum of its noisy coordinates / C)."""
        return self._sums / self.C

    def reveal(self) -> np.ndarray:
        """The inclusion bits: for scoring, after training."""
        return self._included.copy()
