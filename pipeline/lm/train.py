"""DP-SGD for the language model on the shared trainer (``pipeline/dpsgd/``): Poisson sampling of
posts, each post's gradient clipped exactly by the shared engine (``pipeline.clipping.PhantomClipping``:
the tied table's norm includes the cross term between its input and output uses), Gaussian noise,
Adam with linear warm-up and decay; ``train.max_physical_batch`` runs each logical batch in chunks
of at most that many posts (the same clipped sum, noise and update; null: one piece).

Privacy accounting (``plan``). The run's (eps, delta) is shared by the private vocabulary (when
``vocab=private``: ``vocab_share`` of eps and of delta, ``vocab.py``; ``vocab=private_groups``: the
selection's own (eps, delta), spent once before a pretraining) and DP-SGD (the rest), by basic
composition. DP-SGD's noise multiplier is the accountant's smallest for ``steps`` steps of the
Poisson-subsampled Gaussian mechanism at rate q = B / n (one post added or removed moves the
clipped sum by at most C: the sensitivity ``pipeline.dpsgd.add_noise`` is calibrated for); an
empty Poisson sample still releases the noise, and the accountant counts every step.
``clipping=none`` or eps = inf: no noise, no guarantee.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pipeline import checkpoints, dpsgd, progress
from pipeline.lm import engines, streams

ADAM_BETAS = dpsgd.ADAM_BETAS
Diverged = dpsgd.Diverged  # a non-finite loss or gradient: the run ends FAILED
schedule = dpsgd.schedule
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan(dpsgd.Plan):
    """``pipeline.dpsgd.Plan`` (n: the posts; ``eps_spent``: DP-SGD's eps as the accountant reports it,
    plus the vocabulary's share) and the private vocabulary's share."""

    vocab_eps: float = 0.0  # the private vocabulary's share (0 for vocab=public)
    vocab_delta: float = 0.0

    @property
    def spent_eps(self) -> float:
        return self.eps_spent


def plan(*, n_posts: int, batch_size: int, epochs: int, eps: float, delta: float, private: bool,
         vocab_share: float, accountant: str = "prv", vocab_spent: tuple[float, float] = (0.0, 0.0)) -> Plan:
    """The run's sampling rate, steps and noise multiplier (``pipeline.dpsgd.plan``; ``vocab_share`` > 0
    where the vocabulary was selected with DP from these posts, a share of the run's budget).
    ``vocab_spent``: the (eps, delta) of a vocabulary selected once, apart from the run, from posts
    that include these (``vocab=private_groups``, before a pretraining): DP-SGD is planned on what it
    leaves, (eps - eps_v, delta - delta_v), and ``eps_spent`` adds eps_v back (basic composition)."""
    if not 0 <= vocab_share < 1:
        raise ValueError(f"vocab_share must lie in [0, 1), got {vocab_share}")
    if any(vocab_spent):
        if vocab_share:
            raise ValueError("a vocabulary spends a share of the run's budget or one of its own, not both")
        v_eps, v_delta = vocab_spent
        found = dpsgd.plan(n=n_posts, batch_size=batch_size, epochs=epochs, eps=eps - v_eps, delta=delta - v_delta,
                           private=private, accountant=accountant)
        return Plan(**(asdict(found) | {"eps_spent": found.eps_spent + v_eps}), vocab_eps=v_eps, vocab_delta=v_delta)
    found = dpsgd.plan(n=n_posts, batch_size=batch_size, epochs=epochs, eps=eps, delta=delta, private=private,
                       accountant=accountant, share=vocab_share)
    vocab_eps = vocab_share * eps if vocab_share else 0.0  # not 0 x inf for a non-private run
    return Plan(**asdict(found), vocab_eps=vocab_eps, vocab_delta=vocab_share * delta)


@dataclass
class History:
    loss: list[float] = field(default_factory=list)  # mean per-post loss of each epoch's sampled posts
    mean_norm: list[float] = field(default_factory=list)  # mean per-post gradient norm (private runs)
    valid: list[dict] = field(default_factory=list)


def run(model, rows: torch.Tensor, mask: torch.Tensor, run_plan: Plan, *, engine: str, C: float, lr: float,
        warmup: float, weight_decay: float, seed: int, validate: Callable | None = None,
        on_epoch: Callable[[int, dict], None] | None = None, canaries=None, checkpoint: Path | None = None,
        resume: bool = False, key: dict | None = None, validate_every: int = 1,
        max_physical_batch: int | None = None, windows=None, distributed: bool = False) -> History:
    """Train ``model`` in place on the (n, L + 1) ``rows`` and their target ``mask``, or, with
    ``windows`` (``examples.Posts`` of the same n posts), on one window of each sampled post drawn
    afresh at every step (``examples.window_rows``; step t's offsets are drawn for all n posts from
    the seed's ``windows`` stream and t, so they do not depend on chunks, resumption or the model). With
    ``canaries`` (``pipeline.audit.canaries.DiracCanaries``, the whole-run audit), the sampled included
    canaries join every step's clipped sum before the noise, and the noisy sum is observed (their
    sums and generator are checkpointed with the rest, so an audited run resumes too). The
    rows stay where they are; each step's sample moves to the model's device (Poisson sampling and
    noise are drawn on the CPU, from the seed's ``sampling`` and ``noise`` streams). With
    ``checkpoint`` (a path), everything the next epoch depends on (``pipeline.dpsgd.Trainer.state_dict``,
    the history) is saved there at the end of every epoch (``pipeline.checkpoints``); with ``resume``, a
    checkpoint there whose ``key`` matches is continued from, and the run ends with the numbers of an
    uninterrupted one. ``validate`` runs after every ``validate_every``-th epoch and after the last.
    ``distributed``: this process is one rank of several (``ranks.py``; the default process group): its share
    of each micro-batch clipped here, the clipped sums all-reduced (``pipeline.dpsgd.distributed.share_steps``),
    a checkpoint resumed from rank 0's state (pass ``checkpoint`` and ``resume`` on rank 0 only)."""
    if windows is not None and len(windows.length) != rows.shape[0]:
        raise ValueError(f"windows holds {len(windows.length)} posts and rows {rows.shape[0]}: one of each per post")
    if canaries is not None and distributed:
        raise ValueError("canaries audit a run in one process: the audit does not run across ranks")
    if canaries is not None and engine == "none":
        raise ValueError("canaries audit a private run: engine none has no clipped sum to join")
    from pipeline.lm import examples
    from pipeline.lm.examples import example_losses

    bound = engines.make(engine, model, C)
    opt, sched = dpsgd.adam(model, lr=lr, weight_decay=weight_decay, steps=run_plan.steps, warmup=warmup)
    dev = next(model.parameters()).device

    drawn: dict = {}  # step t -> its offsets' uniforms, one per post

    def take(pick: torch.Tensor):
        if windows is None:
            return rows[pick].to(dev), mask[pick].to(dev)
        t = trainer.steps_done
        if t not in drawn:
            drawn.clear()
            u = np.random.default_rng([streams.seed_of(seed, "windows"), t]).random(len(windows.length))
            drawn[t] = torch.from_numpy(u)
        found, found_mask = examples.window_rows(windows, pick, drawn[t][pick])
        return found.to(dev), found_mask.to(dev)

    trainer = dpsgd.Trainer(model, bound.engine, example_losses, take, run_plan, C=C, optimizer=opt, schedule=sched,
                            sampling=torch.Generator().manual_seed(streams.seed_of(seed, "sampling")),
                            noise=torch.Generator().manual_seed(streams.seed_of(seed, "noise")),
                            max_physical_batch=max_physical_batch, canaries=canaries,
                            hint=f"train.lr = {lr}, clipping.C = {C}")
    if distributed:
        from pipeline.dpsgd.distributed import share_steps

        share_steps(trainer, model)
    history = History()
    model.train()  # dropout as configured (Opacus's hooks record in training mode only)
    epochs = run_plan.steps // run_plan.steps_per_epoch
    first = 1
    state = checkpoints.load(checkpoint, key or {}) if resume else None
    if distributed:  # rank 0's checkpoint, on every rank
        from pipeline.dpsgd.distributed import from_rank_0

        state = from_rank_0(state)
    if state is not None:
        trainer.load_state_dict(state["dpsgd"], where=str(checkpoint))
        history = History(**state["history"])
        first = int(state["epoch"]) + 1
        log.info("resume: %s holds epoch %d of %d; continuing from epoch %d", checkpoint, first - 1, epochs, first)
        if on_epoch is not None:  # the restored epochs' metrics, for this run's record
            seen_valid = {int(v["epoch"]): v for v in history.valid}
            for e, loss in enumerate(history.loss, start=1):
                valid = seen_valid.get(e, {})
                on_epoch(e, {"loss": loss, **{f"valid_{k}": v for k, v in valid.items() if k != "epoch"}})
    bar = progress.Progress("train", total=epochs - first + 1, unit="epoch")  # a line per epoch, with a rate and what is left
    for epoch in range(first, epochs + 1):
        bar.start(f"epoch {epoch}/{epochs}")
        found = trainer.epoch(lambda done: bar.note(f"epoch {epoch}/{epochs}, step {done + 1}/{run_plan.steps}"))
        history.loss.append(found.loss)
        history.mean_norm.append(found.mean_norm)
        metrics = {"loss": history.loss[-1]}
        if validate is not None and (epoch % validate_every == 0 or epoch == epochs):
            checked = validate(model)
            history.valid.append({"epoch": epoch, **checked})
            metrics |= {f"valid_{k}": v for k, v in checked.items()}
        if checkpoint is not None:
            checkpoints.save(checkpoint, {"key": key or {}, "epoch": epoch, "history": asdict(history),
                                          "dpsgd": trainer.state_dict()})
        if on_epoch is not None:
            on_epoch(epoch, metrics)
    bar.close()
    return history
