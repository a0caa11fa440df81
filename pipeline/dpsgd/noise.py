"""One noisy DP-SGD gradient: the clipped sum of a logical (Poisson) batch, formed from physical
micro-batches, the Gaussian mechanism on it, and the division by the expected batch size. The one
place DP-SGD's noise is added, for every task and the public API.

**Sensitivity and calibration.** The engine (``pipeline.clipping``: ``step(loss_fn, batch)`` sets
every trainable ``p.grad`` to sum_i c_i g_i with ||c_i g_i|| <= C) clips each example; the sum over
the micro-batches is the sum over the logical batch (each example is in exactly one chunk, and its
clipping coefficient depends on its own gradient only), so adding or removing one example moves it
by at most C, whatever the chunking. N(0, (sigma C)^2) is added to every coordinate once per
logical step (never per chunk), so the step is the Gaussian mechanism with noise multiplier sigma
that the accountant (``pipeline.dpsgd.planning``) was told about. An empty Poisson sample still
releases the noise (a zero sum plus noise): the accountant counts every step.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

def add_noise(params: list[torch.nn.Parameter], sigma: float, C: float, generator: torch.Generator | None) -> None:
    """The Gaussian mechanism on the clipped sum: N(0, (sigma C)^2) added to every ``p.grad`` of
    ``params``, in their order, drawn on ``generator``'s device (a CPU generator gives a GPU run the
    CPU's numbers; without one, the gradients' device's default stream) in the gradients' dtype,
    joined in one fused multiply-add (``add_(noise, alpha)``)."""
    if not 0 <= sigma < float("inf"):
        raise ValueError(f"the noise multiplier must be a finite number >= 0, got {sigma!r}")
    scale = sigma * C
    for p in params:
        if p.grad is None:
            raise RuntimeError("add_noise needs the clipped sum in every p.grad: call the engine's step first")
        noise = torch.randn(p.grad.shape, generator=generator, dtype=p.grad.dtype,
                            device=p.grad.device if generator is None else generator.device).to(p.grad.device)
        if hasattr(p.grad, "device_mesh"):  # a sharded (FSDP2) gradient: its shard of the whole draw, every rank's the same
            from torch.distributed.tensor import distribute_tensor

            noise = distribute_tensor(noise, p.grad.device_mesh, p.grad.placements, src_data_rank=None)
        p.grad.add_(noise, alpha=scale)


def clipped_sum(engine, loss_fn: Callable, batches: Iterable[Any], params: list[torch.nn.Parameter]):
    """sum_i c_i g_i over every micro-batch of ``batches`` left in each ``p.grad`` (zero where no
    example reached ``p``, or no batch was given); the examples' losses and norms, concatenated
    (norms None for a non-private engine). One batch: the engine's own sum, untouched."""
    total, losses, norms = None, [], []
    for batch in batches:
        chunk_losses, chunk_norms = engine.step(loss_fn, batch)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        if total is None:
            total = grads
        else:
            for t, g in zip(total, grads):
                t.add_(g)
        losses.append(chunk_losses)
        if chunk_norms is not None:
            norms.append(chunk_norms)
    if total is None:  # an empty Poisson sample: a zero sum
        device = params[0].device if params else None
        total = [torch.zeros_like(p) for p in params]
        losses, norms = [torch.zeros(0, device=device)], [torch.zeros(0, device=device)]
    for p, t in zip(params, total):
        p.grad = t
    cat = (lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs))
    return cat(losses), (cat(norms) if norms else None)


def noisy_gradient(engine, loss_fn: Callable, batches: Iterable[Any], params: list[torch.nn.Parameter], *,
                   sigma: float, C: float, expected_batch: int, generator: torch.Generator | None,
                   canaries=None):
    """One DP-SGD gradient, (sum_i c_i g_i + sigma C N(0, I)) / B, left in every ``p.grad`` of
    ``params``: the clipped sum over ``batches`` (the logical batch's micro-batches, ``clipped_sum``),
    noise once (none where sigma = 0), then the division by the expected batch size B. With
    ``canaries`` (``pipeline.audit.canaries.DiracCanaries``: the whole-run audit), the sampled included
    canaries join the clipped sum before the noise, and the noisy sum is observed before the
    division. Returns the examples' losses and clipping norms (None: a non-private engine)."""
    losses, norms = clipped_sum(engine, loss_fn, batches, params)
    if canaries is not None:
        canaries.add()
    if sigma > 0:
        add_noise(params, sigma, C, generator)
    if canaries is not None:
        canaries.observe()
    for p in params:
        p.grad = p.grad / expected_batch
    return losses, norms
