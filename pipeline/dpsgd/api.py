"""DP-SGD for any model the clipping engine accepts, in a few lines (``docs/dpsgd.md``):

    from pipeline.dpsgd import DPSGD

    dp = DPSGD(model, data, loss_fn, eps=8.0, delta=1e-5, batch_size=64, epochs=3, max_physical_batch=16)
    dp.fit()                                   # or dp.step() per logical step, dp.epoch() per epoch
    dp.eps_spent(); dp.save("ckpt.pt")         # DPSGD(...same arguments...).load("ckpt.pt") resumes

``data`` is a tensor, or a tuple of tensors, whose first dimension indexes the n examples (the
privacy unit); ``loss_fn(model, batch)`` returns the (n_batch,) per-example losses of ``batch`` (the
same structure, the sampled rows, on the model's device). The plan (noise multiplier for the
target eps), Poisson sampling, micro-batches, clipping engine, noise, accountant and checkpoint are
the pipeline's own (``pipeline/dpsgd/``), the ones its tasks train with.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline.dpsgd import planning
from pipeline.dpsgd.trainer import Epoch, Trainer, adam, schedule

ENGINES = ("phantom", "per_sample", "ghost")
MAX_EPS = 100.0  # pipeline.validation.MAX_EPS: above it the calibration may never end (use a non-private run)


def _engine(name, model: torch.nn.Module, C: float):
    if not isinstance(name, str):
        return name  # an engine object with the shared interface
    if name == "phantom":
        from pipeline.clipping import PhantomClipping

        return PhantomClipping(model, C)
    if name in ("per_sample", "ghost"):
        from pipeline.clipping import opacus

        return (opacus.PerSample if name == "per_sample" else opacus.Ghost)(model, C)
    raise ValueError(f"engine {name!r} is unknown; known: {list(ENGINES)} or an engine object")


class DPSGD:
    """DP-SGD at a target (eps, delta): the one door (see the module's docstring and ``docs/dpsgd.md``).

    Guarantees: Poisson sampling at q = batch_size / n from the trainer's own generator (``seed``);
    each example's gradient clipped to norm C by ``engine`` (Phantom Clipping by default: exact,
    tied weights included); N(0, (sigma C)^2) on the summed clipped gradients once per logical step,
    whatever ``max_physical_batch``; sigma the smallest the accountant (``rdp`` or ``prv``) gives for
    (eps, delta) over ``epochs`` x round(n / batch_size) steps, under add/remove adjacency of one
    example (one row of ``data``). It assumes the noise stays secret (the seed is yours to keep) and
    that nothing else of the run reads the data (your evaluation on it is not covered).

    Refuses (ValueError, before any step): an eps outside (0, 100], a delta outside (0, 1), a
    budget the accountant cannot reach (``pipeline.dpsgd.planning.Unreachable``), a batch_size or
    max_physical_batch that is not a positive integer, and what the engine refuses (a layer it
    cannot clip exactly: ``pipeline.clipping.Unsupported``)."""

    def __init__(self, model: torch.nn.Module, data, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *,
                 eps: float, delta: float, batch_size: int, epochs: int, C: float = 1.0, lr: float = 1e-3,
                 weight_decay: float = 0.0, warmup: float | None = None, accountant: str = "prv",
                 max_physical_batch: int | None = None, engine="phantom", optimizer=None, seed: int = 0):
        tensors = data if isinstance(data, (tuple, list)) else (data,)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError("data must be a tensor or a tuple of tensors (first dimension: the examples)")
        n = int(tensors[0].shape[0])
        if any(int(t.shape[0]) != n for t in tensors):
            raise ValueError(f"data's tensors must have one first dimension (the examples), got {[t.shape[0] for t in tensors]}")
        if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and 0 < eps <= MAX_EPS):
            raise ValueError(f"eps must lie in (0, {MAX_EPS:g}], got {eps!r} (DP-SGD without noise is no DP-SGD)")
        if isinstance(delta, bool) or not (isinstance(delta, (int, float)) and 0 < delta < 1):
            raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
        if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, (int, float))
                                   or not 0 <= warmup <= 1):
            raise ValueError(f"warmup must be None (a constant rate) or the share of the steps spent warming up, in "
                             f"[0, 1], got {warmup!r}")
        for value, key in ((batch_size, "batch_size"), (epochs, "epochs")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if max_physical_batch is not None and (isinstance(max_physical_batch, bool) or not isinstance(max_physical_batch, int)
                                               or max_physical_batch < 1):
            raise ValueError(f"max_physical_batch must be None or a positive integer, got {max_physical_batch!r}")
        if batch_size > n:
            raise ValueError(f"batch_size = {batch_size} is more than the {n} examples of data")
        if not 0 < C < math.inf:
            raise ValueError(f"C must be a positive finite number, got {C!r}")
        self.plan = planning.plan(n=n, batch_size=batch_size, epochs=epochs, eps=float(eps), delta=float(delta),
                                  accountant=accountant)
        self.model, self.data, self.eps = model, tuple(tensors), float(eps)
        device = next(model.parameters()).device
        single = not isinstance(data, (tuple, list))

        def take(indices: torch.Tensor):
            rows = tuple(t[indices.to(t.device)].to(device) for t in self.data)
            return rows[0] if single else rows

        if optimizer is None:
            optimizer, sched = adam(model, lr=lr, weight_decay=weight_decay, steps=self.plan.steps, warmup=warmup)
        else:
            sched = None if warmup is None else torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(self.plan.steps, warmup))
        sampling = torch.Generator().manual_seed(int(seed))
        noise = torch.Generator().manual_seed(int(seed) + 1)
        self.trainer = Trainer(model, _engine(engine, model, C), loss_fn, take, self.plan, C=C, optimizer=optimizer,
                               schedule=sched, sampling=sampling, noise=noise, max_physical_batch=max_physical_batch)
        plain = {k: float(v) if isinstance(v, float) else v for k, v in self.plan.as_params().items()}  # not numpy's
        self.key = {"plan": plain, "max_physical_batch": max_physical_batch, "seed": int(seed)}

    @property
    def steps_done(self) -> int:
        return self.trainer.steps_done

    def step(self):
        """One logical step (``Trainer.step``): the sampled examples' losses and clipping norms."""
        if self.trainer.steps_done >= self.plan.steps:
            raise RuntimeError(f"the plan's {self.plan.steps} steps are taken: more would spend more than eps")
        return self.trainer.step()

    def epoch(self) -> Epoch:
        if self.trainer.steps_done + self.plan.steps_per_epoch > self.plan.steps:
            raise RuntimeError(f"the plan's {self.plan.steps} steps leave no whole epoch")
        return self.trainer.epoch()

    def fit(self, on_epoch: Callable[[int, Epoch], None] | None = None, *, log_every: float | None = 10.0
            ) -> list[Epoch]:
        """Train the epochs the plan has left and return them, one ``Epoch`` each (its mean loss, mean
        clipping norm per sampled example and examples sampled), in order. ``on_epoch(epoch, Epoch)``
        after each (save a checkpoint there). ``log_every``: progress on standard output: a line per
        epoch (steps, loss, mean clipping norm, eps spent so far, elapsed time) and, inside a long
        epoch, the step reached at most every ``log_every`` seconds; None prints nothing."""
        import time

        from pipeline.progress import duration

        out, start = [], time.monotonic()
        last = [start]
        total, per = self.plan.steps, self.plan.steps_per_epoch

        def tick(done: int) -> None:
            if time.monotonic() - last[0] >= log_every:
                last[0] = time.monotonic()
                print(f"DPSGD: step {done + 1}/{total} ({duration(last[0] - start)} so far)", flush=True)

        while self.trainer.steps_done + per <= total:
            out.append(self.trainer.epoch(before_step=tick if log_every is not None else None))
            done = self.trainer.steps_done
            if log_every is not None:
                last[0] = time.monotonic()
                print(f"DPSGD: epoch {done // per}/{total // per}: {done}/{total} steps, loss {out[-1].loss:.4g}, mean "
                      f"clipping norm {out[-1].mean_norm:.3g}, eps spent {self.eps_spent():.3g} of {self.eps:g} "
                      f"({duration(last[0] - start)})", flush=True)
            if on_epoch is not None:
                on_epoch(done // per, out[-1])
        return out

    def eps_spent(self) -> float:
        """The eps (at delta) the accountant gives for the steps taken so far."""
        return self.trainer.eps_spent()

    def save(self, path: str | Path) -> None:
        """A checkpoint (atomic, digested: ``pipeline.checkpoints``) of everything the next step depends on."""
        from pipeline import checkpoints

        checkpoints.save(Path(path), {"key": self.key, **self.trainer.state_dict()})

    def load(self, path: str | Path) -> "DPSGD":
        """Continue from ``save``'s checkpoint of the same plan, chunking and seed (ValueError otherwise)."""
        from pipeline import checkpoints

        try:
            state = checkpoints.load(Path(path), self.key, strict=True)
        except ValueError as why:
            raise ValueError(f"{path} is no checkpoint of this run: {why} (a checkpoint resumes only the same plan, "
                             "max_physical_batch and seed)") from None
        self.trainer.load_state_dict(state, where=str(path))
        return self
