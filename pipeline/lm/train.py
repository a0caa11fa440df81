"""DP-SGD for the language model: Poisson sampling of posts, each post's gradient clipped exactly
by the shared engine (``pipeline.clipping.PhantomClipping``: the tied table's norm includes the
cross term between its input and output uses), Gaussian noise, Adam with linear warm-up and decay.

Privacy accounting (``plan``). The run's (eps, delta) is shared by the private vocabulary (when
``vocab=private``: ``vocab_share`` of eps and of delta, ``vocab.py``) and DP-SGD (the rest), by
basic composition. DP-SGD's noise multiplier is the accountant's smallest for ``steps`` steps of the
Poisson-subsampled Gaussian mechanism at rate q = B / n (one post added or removed moves the
clipped sum by at most C: the sensitivity ``add_noise`` is calibrated for); an
empty Poisson sample still releases the noise, and the accountant counts every step.
``clipping=none`` or eps = inf: no noise, no guarantee.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from pipeline import checkpoints
from pipeline.lm import engines, streams
from pipeline.validation import RunFailed

ADAM_BETAS = (0.9, 0.999)
log = logging.getLogger(__name__)


class Diverged(RunFailed):
    """A non-finite loss or gradient: the run ends FAILED."""


@dataclass(frozen=True)
class Plan:
    n_posts: int
    batch_size: int  # expected: q n
    sample_rate: float
    steps_per_epoch: int
    steps: int
    sigma: float  # DP-SGD's noise multiplier (0: non-private)
    spent_eps: float  # DP-SGD's eps as the accountant reports it, plus the vocabulary's share
    delta: float
    vocab_eps: float  # the private vocabulary's share (0 for vocab=public)
    vocab_delta: float


def plan(*, n_posts: int, batch_size: int, epochs: int, eps: float, delta: float, private: bool,
         vocab_share: float, accountant: str = "prv") -> Plan:
    """The run's sampling rate, steps and noise multiplier (``vocab_share`` > 0 where the
    vocabulary was selected with DP from these posts)."""
    from pipeline import privacy

    if not 0 <= vocab_share < 1:
        raise ValueError(f"vocab_share must lie in [0, 1), got {vocab_share}")
    B = min(batch_size, n_posts)
    q = B / n_posts
    per_epoch = max(1, round(n_posts / B))
    steps = epochs * per_epoch
    if private and math.isfinite(eps):
        e, d = (1 - vocab_share) * eps, (1 - vocab_share) * delta
        sigma = privacy.dpsgd_noise_multiplier(eps=e, delta=d, sample_rate=q, steps=steps, accountant=accountant)
        spent = privacy.dpsgd_spent_epsilon(sigma=sigma, delta=d, sample_rate=q, steps=steps,
                                            accountant=accountant) + vocab_share * eps
    else:
        sigma, spent = 0.0, math.inf
    vocab_eps = vocab_share * eps if vocab_share else 0.0  # not 0 x inf for a non-private run
    return Plan(n_posts, B, q, per_epoch, steps, sigma, spent, delta, vocab_eps, vocab_share * delta)


def schedule(steps: int, warmup: float) -> Callable[[int], float]:
    """Linear warm-up over the first ``warmup`` share of the steps, then linear decay to 0."""
    w = max(1, round(warmup * steps))
    return lambda s: (s + 1) / w if s < w else max(0.0, (steps - s) / max(1, steps - w))


@dataclass
class History:
    loss: list[float] = field(default_factory=list)  # mean per-post loss of each epoch's sampled posts
    mean_norm: list[float] = field(default_factory=list)  # mean per-post gradient norm (private runs)
    valid: list[dict] = field(default_factory=list)


def add_noise(model, sigma: float, C: float, generator: torch.Generator) -> None:
    """The Gaussian mechanism on the clipped sum: N(0, (sigma C)^2) added to every trainable
    ``p.grad`` (each post's clipped gradient has norm <= C, so one post moves the sum by at most C),
    in the parameters' order, whatever the engine."""
    for p in model.parameters():
        if p.requires_grad:  # drawn on the generator's device (the CPU), so a GPU run draws the CPU's numbers
            p.grad.add_(torch.randn(p.grad.shape, generator=generator, dtype=p.grad.dtype).to(p.grad.device),
                        alpha=sigma * C)


def run(model, rows: torch.Tensor, mask: torch.Tensor, run_plan: Plan, *, engine: str, C: float, lr: float,
        warmup: float, weight_decay: float, seed: int, validate: Callable | None = None,
        on_epoch: Callable[[int, dict], None] | None = None, canaries=None, checkpoint: Path | None = None,
        resume: bool = False, key: dict | None = None, validate_every: int = 1) -> History:
    """Train ``model`` in place on the (n, L + 1) ``rows`` and their target ``mask``. With
    ``canaries`` (``pipeline.canaries.DiracCanaries``, the whole-run audit), the sampled included
    canaries join every step's clipped sum before the noise, and the noisy sum is observed (their
    sums and generator are checkpointed with the rest, so an audited run resumes too). The
    rows stay where they are; each step's sample moves to the model's device (Poisson sampling and
    noise are drawn on the CPU). With ``checkpoint`` (a path), everything the next epoch depends on
    (model, optimizer, schedule, both generators, torch's global generator, the history, the
    accountant's steps so far) is saved there at the end of every epoch (``pipeline.checkpoints``);
    with ``resume``, a checkpoint there whose ``key`` matches is continued from, and the run ends
    with the numbers of an uninterrupted one. ``validate`` runs after every ``validate_every``-th
    epoch and after the last."""
    if canaries is not None and engine == "none":
        raise ValueError("canaries audit a private run: engine none has no clipped sum to join")
    clip = engines.make(engine, model, C)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=ADAM_BETAS, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(run_plan.steps, warmup))
    sampler = torch.Generator().manual_seed(streams.seed_of(seed, "sampling"))  # Poisson sampling
    gen = torch.Generator().manual_seed(streams.seed_of(seed, "noise"))  # DP-SGD's noise
    history = History()
    model.train()  # dropout as configured (Opacus's hooks record in training mode only)
    dev = next(model.parameters()).device
    epochs = run_plan.steps // run_plan.steps_per_epoch
    first = 1
    state = checkpoints.load(checkpoint, key or {}) if resume else None
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["schedule"])
        sampler.set_state(state["sampler"])
        gen.set_state(state["noise"])
        torch.set_rng_state(state["cpu_rng"])
        if canaries is not None:
            if state.get("canaries") is None:
                raise ValueError(f"{checkpoint} holds no canaries' state: an audited run resumes only its own checkpoint")
            canaries.load_state(state["canaries"])
        elif state.get("canaries") is not None:  # its sums held canaries: no model of a plain run
            raise ValueError(f"{checkpoint} is an audited run's (its sums held canaries): a plain run does not resume it")
        history = History(**state["history"])
        first = int(state["epoch"]) + 1
        log.info("resume: %s holds epoch %d of %d; continuing from epoch %d", checkpoint, first - 1, epochs, first)
        if on_epoch is not None:  # the restored epochs' metrics, for this run's record
            seen_valid = {int(v["epoch"]): v for v in history.valid}
            for e, loss in enumerate(history.loss, start=1):
                valid = seen_valid.get(e, {})
                on_epoch(e, {"loss": loss, **{f"valid_{k}": v for k, v in valid.items() if k != "epoch"}})
    for epoch in range(first, epochs + 1):
        loss_sum, norm_sum, seen = 0.0, 0.0, 0
        for _ in range(run_plan.steps_per_epoch):
            pick = (torch.rand(run_plan.n_posts, generator=sampler) < run_plan.sample_rate).nonzero().squeeze(1)
            if len(pick):
                losses, norms = clip.step((rows[pick].to(dev), mask[pick].to(dev)))
            else:  # an empty Poisson sample: a zero sum (the noise alone, for a private run)
                losses, norms = torch.zeros(0), None
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
            if clip.private:
                if norms is not None:
                    norm_sum += float(norms.sum())
                if canaries is not None:
                    canaries.add()
                add_noise(model, run_plan.sigma, C, gen)
                if canaries is not None:
                    canaries.observe()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad /= run_plan.batch_size
            step_loss = float(losses.detach().sum())
            if not math.isfinite(step_loss) or not all(bool(torch.isfinite(p.grad).all())
                                                       for p in model.parameters() if p.grad is not None):
                raise Diverged(f"training diverged in epoch {epoch}: a loss or gradient is not finite "
                               f"(lr = {lr}, C = {C}); the run ends FAILED")
            opt.step()
            sched.step()
            loss_sum += step_loss
            seen += len(pick)
        history.loss.append(loss_sum / max(seen, 1))
        history.mean_norm.append(norm_sum / max(seen, 1) if clip.private else math.nan)
        metrics = {"loss": history.loss[-1]}
        if validate is not None and (epoch % validate_every == 0 or epoch == epochs):
            found = validate(model)
            history.valid.append({"epoch": epoch, **found})
            metrics |= {f"valid_{k}": v for k, v in found.items()}
        if checkpoint is not None:
            checkpoints.save(checkpoint, {
                "key": key or {}, "epoch": epoch, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "schedule": sched.state_dict(), "sampler": sampler.get_state(), "noise": gen.get_state(),
                "cpu_rng": torch.get_rng_state(), "history": asdict(history),
                "canaries": None if canaries is None else canaries.state(),
                "accountant": {"sigma": run_plan.sigma, "sample_rate": run_plan.sample_rate,
                               "steps": epoch * run_plan.steps_per_epoch}})
        if on_epoch is not None:
            on_epoch(epoch, metrics)
    return history
