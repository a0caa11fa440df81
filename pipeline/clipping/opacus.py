"""Opacus's engines behind the same interface as ``PhantomClipping`` (``step(loss_fn, batch) ->
(losses, norms)``, the clipped sum left in ``p.grad``), for comparing against it: ``PerSample``,
Opacus's hooks mode (every example's gradient instantiated; the reference), and ``Ghost``, its fast
gradient clipping (no per-example gradients; it refuses a parameter used twice, so untied models
only, refused here by name before any compute). Both clip with c_i = min(1, C / (||g_i|| + 1e-6)).

Opacus records activations in training mode only: call ``model.train()`` (with dropout off where a
comparison must be exact). Inputs that reach an embedding must be contiguous (Opacus views them).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from pipeline.clipping.engine import Unsupported, coefficients


def shared_parameters(model: nn.Module) -> list[str]:
    """Names of parameters held by more than one module (a tied embedding): what ghost clipping refuses."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    return [names[0] for names in holders.values() if len(names) > 1]


class PerSample:
    """Opacus's hooks mode: per-example gradients, then their clipped sum."""

    private = True

    def __init__(self, model: nn.Module, C: float):
        from opacus import GradSampleModule

        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.C = float(C)
        self.gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any):
        self.gsm.zero_grad(set_to_none=True)
        losses = loss_fn(self.gsm, batch)
        losses.sum().backward()
        grads = [p.grad_sample for p in self.params]
        norms = torch.stack([g.flatten(1).square().sum(1) for g in grads]).sum(0).sqrt()
        c = coefficients(norms, C=self.C)
        for p, g in zip(self.params, grads):
            p.grad = torch.einsum("n,n...->...", c, g)
            p.grad_sample = None
        return losses.detach(), norms.detach()


class Ghost:
    """Opacus's fast gradient clipping: per-example norms without per-example gradients, the clipped
    sum by a second backward pass of sum_i c_i L_i."""

    private = True

    def __init__(self, model: nn.Module, C: float):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        tied = shared_parameters(model)
        if tied:
            raise Unsupported(f"Opacus's ghost clipping cannot clip a parameter used twice ({tied[0]} is tied): "
                              "use PhantomClipping, or untie the model")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.C = float(C)
        self.gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="sum",
                                                        max_grad_norm=self.C, use_ghost_clipping=True)

    def step(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any):
        self.gsm.zero_grad(set_to_none=True)
        losses = loss_fn(self.gsm, batch)
        losses.sum().backward(retain_graph=True)
        norms = self.gsm.get_norm_sample().detach()
        c = coefficients(norms, C=self.C)
        self.gsm.zero_grad(set_to_none=True)
        self.gsm.disable_hooks()
        try:
            (c * losses).sum().backward()
        finally:
            self.gsm.enable_hooks()
        return losses.detach(), norms
