"""``DistributedDPSGD``: ``pipeline.dpsgd.DPSGD`` over ``torch.distributed``, the model replicated on
every rank (what ``DistributedDataParallel`` does, without its hooks: they would average the
gradients before they are clipped). Imported from here: ``from pipeline.dpsgd.distributed import
DistributedDPSGD``.

**The privacy argument is one process's, unchanged.** Every rank draws the same Poisson sample from
the same sampling stream (the same ``seed``), and cuts it into the same physical micro-batches. Of
each micro-batch, rank r computes the examples at positions r, r + world, r + 2 world, ... with the
clipping engine (each example clipped to C by its own gradient alone, as in one process), and the
ranks' clipped sums are all-reduced: every rank then holds the micro-batch's clipped sum, the one a
single process forms. The noise is drawn from one noise stream that every rank replays identically
(the same ``seed``) and added once to that sum, so the released gradient is the clipped sum plus one
draw of N(0, (sigma C)^2 I): the Gaussian mechanism the accountant was told about, with one accountant.
Every rank applies the same update and stays a replica. The one-process result is reproduced to
float tolerance (the sums are added in another order). The clipped sums are all-reduced once per
micro-batch (one collective of the parameters' size each; with ``max_physical_batch`` None, once per
step). A checkpoint is written by rank 0 (``save`` is called on every rank): the model, the sampling
and noise streams and the accountant are the same on every rank, so one process or any world size
resumes it; the global generator it holds (dropout's) is rank 0's, so with dropout a resumed run
draws other masks than an uninterrupted one (privacy unaffected).

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
    spare: Any = None  # FSDP2: the micro-batch's first example, stepped on with a zero loss where batch is None


class _Reduced:
    """The engine on this rank's share of each micro-batch, its clipped sum all-reduced: every rank leaves
    the whole micro-batch's clipped sum in ``p.grad`` and returns its losses and norms in the micro-batch's
    order, as one process's engine does."""

    def __init__(self, engine, params: list[torch.nn.Parameter], group, sharded: bool = False):
        self.engine, self.params, self.group, self.sharded = engine, params, group, sharded
        self.private = getattr(engine, "private", True)

    def step(self, loss_fn, share: _Share):
        device = self.params[0].device
        dtype = torch.float32
        for p in self.params:  # a float64 parameter's sum stays float64
            dtype = torch.promote_types(dtype, p.dtype)
        losses = torch.zeros(share.size, device=device, dtype=dtype)
        norms = torch.zeros(share.size, device=device, dtype=dtype)
        if self.sharded:
            # FSDP2: every rank runs the step (its all-gathers and reduce-scatters are collectives); the
            # reduce-scatter leaves in each rank's shard of p.grad the sum over the ranks' clipped sums. A rank
            # with no example of the micro-batch steps on one example with its loss times zero: it adds zeros
            if share.batch is not None:
                mine_losses, mine_norms = self.engine.step(loss_fn, share.batch)
                losses[share.rank::share.world] = mine_losses.detach().to(losses.dtype)
                if mine_norms is not None:
                    norms[share.rank::share.world] = mine_norms.to(norms.dtype)
            else:
                self.engine.step(lambda model, batch: loss_fn(model, batch) * 0, share.spare)
            flat = torch.cat([losses, norms])
            dist.all_reduce(flat, group=self.group)
            return flat[:share.size].clone(), (flat[share.size:].clone() if self.private else None)
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


def _digest(data) -> str:
    """A fingerprint of ``data``'s tensors (shapes, dtypes and bytes): the ranks must hold the same data set."""
    import hashlib

    found = hashlib.sha256()
    for t in data if isinstance(data, (tuple, list)) else (data,):
        if isinstance(t, torch.Tensor):
            found.update(f"{tuple(t.shape)} {t.dtype}".encode())
            found.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return found.hexdigest()


def _rank_0(group) -> int:
    """The global rank of ``group``'s rank 0 (the default group's: 0)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def share_steps(trainer, model: torch.nn.Module, group=None, *, sharded: bool = False) -> None:
    """Make ``trainer`` (a ``pipeline.dpsgd.Trainer``, built alike on every rank: the same plan, chunking,
    seed and data) this rank's part of one distributed DP-SGD, as the module's docstring says: rank 0's
    initial weights broadcast, each micro-batch's examples dealt to the ranks (positions r, r + world, ...),
    each rank's clipped sum all-reduced before the noise, which every rank draws alike. Call it on every
    rank, before the first step. ``DistributedDPSGD`` is built on it; so is a task's own trainer (the
    language model's cells under torchrun, ``train.distributed``)."""
    source = _rank_0(group)
    from torch.distributed.tensor import DTensor

    for t in list(model.parameters()) + list(model.buffers()):  # one replica: rank 0's initial weights
        if not isinstance(t, DTensor):  # a sharded parameter is held once, in its shards
            dist.broadcast(t.data, src=source, group=group)
    take, rank, world = trainer.take, dist.get_rank(group), dist.get_world_size(group)

    def share(indices: torch.Tensor) -> _Share:
        mine = indices[rank::world]
        spare = take(indices[:1]) if sharded and not len(mine) else None
        return _Share(take(mine) if len(mine) else None, len(indices), rank, world, spare)

    trainer.take = share
    trainer.engine = _Reduced(trainer.engine, trainer.params, group, sharded)


def from_rank_0(value: Any, group=None) -> Any:
    """Rank 0's ``value`` (any picklable object: a checkpoint's state, a decision) on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=_rank_0(group), group=group)
    return box[0]


class DistributedDPSGD(DPSGD):
    """``DPSGD`` (same arguments, same guarantees) on every rank of the initialised default process
    group (or ``group``): see the module's docstring. Call every method on every rank (``save``
    included). Refuses, on every rank at once (no rank left waiting): a model wrapped in
    ``DistributedDataParallel`` (its hooks average unclipped gradients), parameters on several devices,
    an argument any rank refuses, and ranks whose arguments or data differ (C, eps, delta, the plan,
    chunking, seed, engine, optimizer settings, the data's bytes). With NCCL, each rank's model must be on
    its own GPU (its device is made the current one)."""

    def __init__(self, model: torch.nn.Module, data, loss_fn, *, group=None, **kwargs):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedDPSGD needs torch.distributed's process group: call "
                               "torch.distributed.init_process_group first (or use DPSGD in one process)")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("pass the bare model, not a DistributedDataParallel: its hooks average the gradients "
                             "before they are clipped; DistributedDPSGD all-reduces the clipped sums itself")
        devices = {p.device for p in model.parameters()}
        if len(devices) > 1:
            raise ValueError(f"the model's parameters are on several devices ({sorted(map(str, devices))}): "
                             "DistributedDPSGD replicates one model per rank on one device")
        device = devices.pop() if devices else torch.device("cpu")
        from pipeline.clipping.engine import _fsdp_modules

        sharded = _fsdp_modules(model)  # FSDP2 (fully_shard): the clipped sums reach the shards by its reduce-scatter
        if sharded:
            for m in sharded:  # its reduce-scatter then sums the ranks' clipped sums (FSDP's default averages them)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            if kwargs.get("engine", "phantom") == "phantom":
                from pipeline.clipping import PhantomClipping

                kwargs["engine"] = PhantomClipping(model, kwargs.get("C", 1.0), sum_by="backward")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's object collectives run on the current device
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        error = None
        try:
            super().__init__(model, data, loss_fn, **kwargs)
        except Exception as err:  # noqa: BLE001 -- reported by every rank below, so that none waits for ever
            error = err
        settings = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else type(v).__name__)
                    for k, v in sorted(kwargs.items())}
        mine = {"error": None if error is None else f"{type(error).__name__}: {error}",
                "settings": settings, "data": _digest(data),
                "key": None if error is not None else {**self.key, "n": self.plan.n}}
        found = [None] * self.world
        dist.all_gather_object(found, mine, group=group)
        failed = [(r, f["error"]) for r, f in enumerate(found) if f["error"] is not None]
        if failed:
            if error is not None:
                raise error
            raise ValueError(f"rank {failed[0][0]} refused its DPSGD arguments ({failed[0][1]}); all ranks stop")
        differ = [what for what in ("settings", "data", "key") if any(f[what] != found[0][what] for f in found)]
        if differ:
            raise ValueError(f"the ranks' DPSGD {' and '.join(differ)} differ (every rank must pass the same arguments "
                             f"and hold the same data: one Poisson sample is drawn over all of it): "
                             f"{[f[differ[0]] for f in found] if differ[0] != 'data' else 'data digests differ'}")
        share_steps(self.trainer, model, group, sharded=bool(sharded))
        self.sharded = bool(sharded)

    def fit(self, on_epoch=None, *, log_every: float | None = 10.0):
        """``DPSGD.fit`` on every rank; progress printed by rank 0 only."""
        return super().fit(on_epoch, log_every=log_every if self.rank == 0 else None)

    def _refuse_sharded(self, what: str) -> None:
        if self.sharded:
            raise NotImplementedError(f"DistributedDPSGD.{what}: checkpoints of a model sharded by FSDP2 (fully_shard) "
                                      "are not supported (each rank holds its shards of the weights and of Adam's "
                                      "state; this checkpoint would keep rank 0's alone); save the replicated model, "
                                      "or gather the state with torch.distributed.checkpoint")

    def load(self, path, *args, **kwargs):
        """``DPSGD.load`` on every rank (refused for a model sharded by FSDP2, as ``save`` is)."""
        self._refuse_sharded("load")
        return super().load(path, *args, **kwargs)

    def save(self, path) -> None:
        """Call on every rank: rank 0 writes the checkpoint (the model, the sampling and noise streams and the
        accountant are the same on every rank; the global generator saved, which draws dropout, is rank
        0's); every rank then learns whether the write succeeded (a failure raises on all of them). On
        several machines the path must be on a file system they share. A model sharded by FSDP2: refused
        (its weights are held in shards, which this checkpoint does not gather)."""
        self._refuse_sharded("save")
        error = None
        if self.rank == 0:
            try:
                super().save(path)
            except Exception as err:  # noqa: BLE001 -- every rank raises, none waits
                error = err
        status = from_rank_0(None if error is None else f"{type(error).__name__}: {error}", self.group)
        if error is not None:
            raise error
        if status is not None:
            raise OSError(f"rank 0 could not write the checkpoint {path}: {status}")
