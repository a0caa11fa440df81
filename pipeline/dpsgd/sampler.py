"""Poisson sampling, the sampling the accountant assumes: each of the n examples is in a step's
batch independently with probability q (so the batch's size varies; its expectation is q n). The
draws come from the sampler's own generator, on that generator's device (one uniform per example
per step), so a run's batches depend on its seed and the step only."""

from __future__ import annotations

import torch


class PoissonSampler:
    def __init__(self, n: int, sample_rate: float, generator: torch.Generator):
        if not 0 < sample_rate <= 1:
            raise ValueError(f"the sampling rate must lie in (0, 1], got {sample_rate!r}")
        self.n, self.sample_rate, self.generator = int(n), float(sample_rate), generator

    def sample(self) -> torch.Tensor:
        """The indices of one step's batch, ascending, on the generator's device."""
        u = torch.rand(self.n, generator=self.generator, device=self.generator.device)
        return (u < self.sample_rate).nonzero().squeeze(1)


def chunks(pick: torch.Tensor, most: int | None) -> list[torch.Tensor]:
    """``pick`` in physical micro-batches of at most ``most`` examples (None: one piece, ``pick`` itself;
    an empty sample: none)."""
    if len(pick) == 0:
        return []
    if most is None or len(pick) <= most:
        return [pick]
    return list(torch.split(pick, int(most)))
