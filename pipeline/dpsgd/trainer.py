"""DP-SGD's loop, once for every task and the public API: each logical step draws a Poisson sample
(``sampler.py``), runs it through the clipping engine in physical micro-batches of at most
``max_physical_batch`` examples, adds the Gaussian noise once to the summed clipped gradients and
divides by the expected batch size (``noise.py``), checks that the step is finite, and takes the
optimizer's and the learning-rate schedule's step. ``state_dict`` holds everything the next step
depends on (model, optimizer, schedule, the sampling and noise streams, torch's global generators,
the steps taken, the accountant's history, an audit's canaries), so a resumed run ends with the
numbers of an uninterrupted one.

**Micro-batches are exact.** The clipped sum of the logical batch is the sum of its chunks' clipped
sums (each example's coefficient is its own), the noise is drawn once per logical step, and the
update is that of the whole batch: results depend on ``max_physical_batch`` within float tolerance
only, and peak memory follows the chunk, not the batch. ``None`` (every stage's default) runs each
logical batch in one piece, the arithmetic of every recorded result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pipeline.dpsgd import noise as dp_noise
from pipeline.dpsgd.planning import Plan, spent
from pipeline.dpsgd.sampler import PoissonSampler, chunks
from pipeline.validation import RunFailed

ADAM_BETAS = (0.9, 0.999)  # Adam's moment decays: torch's defaults (both tasks' papers give none)


class Diverged(RunFailed):
    """A non-finite loss, gradient or parameter: the run is FAILED, never FINISHED with NaN metrics."""


def schedule(steps: int, warmup: float) -> Callable[[int], float]:
    """Learning-rate factor: linear warm-up over the first ``warmup`` fraction of the steps, then
    linear decay to 0 at the last step."""
    w = max(1, round(warmup * steps))

    def factor(step: int) -> float:
        if step < w:
            return (step + 1) / w
        return max(0.0, (steps - step) / max(1, steps - w))

    return factor


def adam(model: torch.nn.Module, *, lr: float, weight_decay: float, steps: int, warmup: float | None):
    """Adam (``ADAM_BETAS``) on the model's parameters and its learning-rate schedule (``schedule``;
    ``warmup=None``: a constant rate)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=ADAM_BETAS, weight_decay=weight_decay)
    factor = (lambda s: 1.0) if warmup is None else schedule(steps, warmup)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


class NonPrivate:
    """The plain sum of the examples' gradients, no clipping (the non-private baseline), behind the
    engines' interface: ``step(loss_fn, batch)`` sets every ``p.grad`` reached to the sum."""

    private = False

    def __init__(self, model: torch.nn.Module, C: float | None = None):
        self.model = model

    def step(self, loss_fn: Callable, batch: Any):
        self.model.zero_grad(set_to_none=True)
        losses = loss_fn(self.model, batch)
        losses.sum().backward()
        return losses.detach(), None


def finite(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Whether the step's loss, and every gradient DP-SGD left in ``p.grad``, are finite: a (2,) bool
    tensor on the device, read on the host only when asked."""
    grads = [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
    grads = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]  # a sharded gradient: every shard's
    return torch.stack([torch.isfinite(loss), torch.stack(grads).all() if grads else torch.isfinite(loss)])


def finite_step(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> bool:
    """``finite``, read on the host (a device synchronisation)."""
    return bool(finite(loss, params).all())


@dataclass
class Epoch:
    """What an epoch's steps report: the mean loss and the mean clipping norm per sampled example
    (NaN for a non-private engine) and the examples sampled."""

    loss: float
    mean_norm: float
    seen: int


class Trainer:
    """DP-SGD on ``model`` with ``engine`` (``step(loss_fn, batch) -> (losses, norms)``, the clipped sum
    in ``p.grad``: ``pipeline.clipping.PhantomClipping``, Opacus's ``PerSample``/``Ghost``, or
    ``NonPrivate``), as ``plan`` (``pipeline.dpsgd.planning``) calibrated it.

    ``take(indices) -> batch`` turns a sample's (or a chunk's) example indices into what ``loss_fn``
    reads, on the model's device. ``sampling`` draws the Poisson samples, ``noise`` the Gaussian noise
    (default: ``sampling``, one stream for both). ``hint`` ends a divergence's message (the keys to
    change)."""

    def __init__(self, model: torch.nn.Module, engine, loss_fn: Callable, take: Callable[[torch.Tensor], Any],
                 plan: Plan, *, C: float, optimizer: torch.optim.Optimizer, schedule=None,
                 sampling: torch.Generator, noise: torch.Generator | None = None,
                 max_physical_batch: int | None = None, canaries=None, hint: str = ""):
        if max_physical_batch is not None and (isinstance(max_physical_batch, bool) or int(max_physical_batch) < 1):
            raise ValueError(f"max_physical_batch must be None or a positive integer, got {max_physical_batch!r}")
        if canaries is not None and not getattr(engine, "private", True):
            raise ValueError("canaries audit a private run: a non-private engine has no clipped sum to join")
        self.model, self.engine, self.loss_fn, self.take, self.plan = model, engine, loss_fn, take, plan
        self.C, self.optimizer, self.schedule, self.canaries = float(C), optimizer, schedule, canaries
        self.sampling, self.noise = sampling, sampling if noise is None else noise
        self.sampler = PoissonSampler(plan.n, plan.sample_rate, sampling)
        self.max_physical_batch = None if max_physical_batch is None else int(max_physical_batch)
        self.hint = hint
        self.private = bool(getattr(engine, "private", True))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.steps_done = 0

    def step(self, check: bool = True):
        """One logical DP-SGD step; returns the sampled examples' losses and clipping norms (None:
        a non-private engine). ``check``: a non-finite loss or gradient raises ``Diverged`` here (a
        device synchronisation); ``epoch`` checks its steps at its end instead."""
        pick = self.sampler.sample()
        batches = (self.take(chunk) for chunk in chunks(pick, self.max_physical_batch))
        sigma = self.plan.sigma if self.private else 0.0
        losses, norms = dp_noise.noisy_gradient(self.engine, self.loss_fn, batches, self.params, sigma=sigma, C=self.C,
                                                expected_batch=self.plan.batch_size, generator=self.noise,
                                                canaries=self.canaries)
        self.ok = finite(losses.sum(), self.params)
        if check:
            self._diverged([self.ok], self.steps_done)
        self.optimizer.step()
        if self.schedule is not None:
            self.schedule.step()
        self.steps_done += 1
        return losses, norms

    def _diverged(self, oks: list[torch.Tensor], first: int) -> None:
        """``Diverged`` naming the first of the steps ``first``, ``first + 1``, ... whose flag in ``oks``
        is false (one read of them all)."""
        flags = torch.stack(oks).tolist()
        bad = next((k for k, (loss, grads) in enumerate(flags) if not (loss and grads)), None)
        if bad is None:
            return
        step, what = first + bad, "loss" if not flags[bad][0] else "gradient"
        raise Diverged(f"training diverged at step {step + 1} of {self.plan.steps} (epoch "
                       f"{step // self.plan.steps_per_epoch + 1}): the {what} is not finite"
                       f"{f' ({self.hint})' if self.hint else ''}; the run ends FAILED")

    def epoch(self, before_step: Callable[[int], None] | None = None) -> Epoch:
        """``plan.steps_per_epoch`` steps (``before_step(steps taken)`` before each). Nothing is read on
        the host until the epoch ends (no synchronisation per step): the sums stay on the device, in
        float64, and so does each step's finiteness, checked once at the end (a step that diverged
        raises ``Diverged`` then, naming it, before any checkpoint holds its parameters)."""
        device = self.params[0].device
        loss_sum, norm_sum = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(2))
        seen, oks, first = 0, [], self.steps_done
        for _ in range(self.plan.steps_per_epoch):
            if before_step is not None:
                before_step(self.steps_done)
            losses, norms = self.step(check=False)
            oks.append(self.ok)
            loss_sum += losses.sum().double()
            seen += len(losses)
            if norms is not None:
                norm_sum += norms.sum().double()
        self._diverged(oks, first)
        return Epoch(float(loss_sum) / max(seen, 1), float(norm_sum) / max(seen, 1) if self.private else math.nan, seen)

    def check_parameters(self, epoch: int) -> None:
        """``Diverged`` where a parameter is not finite (after an epoch)."""
        if not all(bool(torch.isfinite(p).all()) for p in self.model.parameters()):
            raise Diverged(f"training diverged in epoch {epoch}: a parameter is not finite"
                           f"{f' ({self.hint})' if self.hint else ''}; the run ends FAILED")

    def eps_spent(self) -> float:
        """The eps (at the plan's delta, DP-SGD's share) the accountant gives for the steps taken so far."""
        p = self.plan
        sigma = p.sigma if self.private else 0.0
        return spent(sigma, delta=(1 - p.share) * p.delta, sample_rate=p.sample_rate, steps=self.steps_done,
                     accountant=p.accountant)

    def state_dict(self) -> dict:
        """Everything the next step depends on (tensors and plain values: ``torch.load(weights_only=True)`` reads it)."""
        cuda = sorted({p.device.index or 0 for p in self.params if p.device.type == "cuda"})
        return {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "schedule": None if self.schedule is None else self.schedule.state_dict(),
            "sampler": self.sampling.get_state(), "noise": self.noise.get_state(), "cpu_rng": torch.get_rng_state(),
            "cuda_rng": {d: torch.cuda.get_rng_state(d) for d in cuda}, "steps": self.steps_done,
            "accountant": {"accountant": self.plan.accountant,  # its history: (sigma, q, steps) so far
                           "history": [[self.plan.sigma, self.plan.sample_rate, self.steps_done]]},
            "canaries": None if self.canaries is None else self.canaries.state()}

    def load_state_dict(self, state: dict, where: str = "the checkpoint") -> None:
        """Put ``state_dict``'s states back. The sampler's state is set before the noise's: where one
        generator draws both, the noise's (the later) is the one it continues from."""
        if self.canaries is not None and state.get("canaries") is None:
            raise ValueError(f"{where} holds no canaries' state: an audited run resumes only its own checkpoint")
        if self.canaries is None and state.get("canaries") is not None:  # its sums held canaries: no plain run's
            raise ValueError(f"{where} is an audited run's (its sums held canaries): a plain run does not resume it")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.schedule is not None:
            self.schedule.load_state_dict(state["schedule"])
        self.sampling.set_state(state["sampler"])
        self.noise.set_state(state["noise"])
        torch.set_rng_state(state["cpu_rng"])
        for d, rng in (state.get("cuda_rng") or {}).items():
            torch.cuda.set_rng_state(rng, int(d))
        self.steps_done = int(state["steps"])
        if self.canaries is not None:
            self.canaries.load_state(state["canaries"])
