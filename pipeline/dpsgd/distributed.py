"""``DistributedDPSGD``: ``pipeline.dpsgd.DPSGD`` over ``torch.distributed``, the model replicated on
every rank (what ``DistributedDataParallel`` does, without its hooks: they would average the
gradients before they are clipped). Imported from here (``from pipeline.dpsgd.distributed import
DistributedDPSGD``): a process of one rank never loads ``torch.distributed``.

**The privacy argument is one process's, unchanged.** Every rank draws the same Poisson sample from
the same sampling stream (the same ``seed``), and cuts it into the same physical micro-batches. Of
each micro-batch, rank r computes the examples at positions r, r + world, r + 2 world, ... with the
clipping engine (each example clipped to C by its own gradient alone, as in one process), and the
ranks' clipped sums are all-reduced: every rank then holds the micro-batch's clipped sum, the one a
single process forms. The noise is drawn from one noise stream that every rank replays identically
(the same ``seed``) and added once to that sum, so the released gradient is the clipped sum plus one
draw of N(0, (sigma C)^2 I): the Gaussian mechanism the accountant was told about, with one accountant.
Every rank applies the same update and stays a replica. The one-process result is reproduced to
float tolerance (the sums are added in another order). A checkpoint holds no rank's state (the
streams and the model are the same everywhere): ``save`` on rank 0, any world size resumes it.

What the ranks must share: the model's initial parameters (rank 0's are broadcast when the trainer
is made), ``data`` (every rank holds it all, and reads only its share of each micro-batch), and the
arguments (the plan, chunking and seed; checked across the ranks when the trainer is made).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.dpsgd.api import DPSGD


@dataclass
class _Share:
    """Rank ``rank``'s examples of one micro-batch of ``size`` examples (None: no example of it is this rank's)."""
    batch: Any
    size: int
    rank: int
    world: int


class _Reduced:
    """The engine on this rank's share of each micro-batch, its clipped sum all-reduced: every rank leaves
    the whole micro-batch's clipped sum in ``p.grad`` and returns its losses and norms in the micro-batch's
    order, as one process's engine does."""

    def __init__(self, engine, params: list[torch.nn.Parameter], group):
        self.engine, self.params, self.group = engine, params, group
        self.private = getattr(engine, "private", True)

    def step(self, loss_fn, share: _Share):
        device = self.params[0].device
        dtype = torch.promote_types(self.params[0].dtype, torch.float32)  # a float64 model's sums stay float64
        losses = torch.zeros(share.size, device=device, dtype=dtype)
        norms = torch.zeros(share.size, device=device, dtype=dtype)
        if share.batch is not None:
            mine_losses, mine_norms = self.engine.step(loss_fn, share.batch)
            losses[share.rank::share.world] = mine_losses.detach().to(losses.dtype)
            if mine_norms is not None:
                norms[share.rank::share.world] = mine_norms.to(norms.dtype)
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        else:
            grads = [torch.zeros_like(p) for p in self.params]
        # one collective for the clipped sums, the losses and the norms (each rank's entries are zero elsewhere)
        flat = torch.cat([g.reshape(-1).to(losses.dtype) for g in grads] + [losses, norms])
        dist.all_reduce(flat, group=self.group)
        start = 0
        for p in self.params:
            p.grad = flat[start:start + p.numel()].view_as(p).to(p.dtype).clone()
            start += p.numel()
        return flat[start:start + share.size].clone(), (flat[start + share.size:].clone() if self.private else None)


class DistributedDPSGD(DPSGD):
    """``DPSGD`` (same arguments, same guarantees) on every rank of the initialised default process
    group (or ``group``): see the module's docstring. Refuses a model wrapped in
    ``DistributedDataParallel`` (its hooks average unclipped gradients) and ranks whose arguments differ."""

    def __init__(self, model: torch.nn.Module, data, loss_fn, *, group=None, **kwargs):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedDPSGD needs torch.distributed's process group: call "
                               "torch.distributed.init_process_group first (or use DPSGD in one process)")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("pass the bare model, not a DistributedDataParallel: its hooks average the gradients "
                             "before they are clipped; DistributedDPSGD all-reduces the clipped sums itself")
        super().__init__(model, data, loss_fn, **kwargs)
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        key = [None] * self.world
        dist.all_gather_object(key, {**self.key, "n": self.plan.n}, group=group)
        if any(k != key[0] for k in key):
            raise ValueError(f"the ranks' DPSGD arguments differ (plan, max_physical_batch, seed, data size): {key}")
        for t in list(model.parameters()) + list(model.buffers()):  # one replica: rank 0's initial weights
            dist.broadcast(t.data, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        trainer = self.trainer
        take, rank, world = trainer.take, self.rank, self.world

        def share(indices: torch.Tensor) -> _Share:
            mine = indices[rank::world]
            return _Share(take(mine) if len(mine) else None, len(indices), rank, world)

        trainer.take = share
        trainer.engine = _Reduced(trainer.engine, trainer.params, group)

    def save(self, path) -> None:
        """Rank 0 writes the checkpoint (every rank holds the same state); the others wait for it."""
        if self.rank == 0:
            super().save(path)
        dist.barrier(group=self.group)
