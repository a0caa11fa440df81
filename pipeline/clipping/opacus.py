"""Opacus's engines behind the same interface as ``PhantomClipping`` (``step(loss_fn, batch) ->
(losses, norms)``, the clipped sum left in ``p.grad``), for comparing against it: ``PerSample``,
Opacus's hooks mode (every example's gradient instantiated; the reference), and ``Ghost``, its fast
gradient clipping (no per-example gradients; it refuses a parameter used twice, so untied models
only: a parameter held by two modules is refused by name before any compute, a module called twice in
one forward pass, such as a table used as input lookup and output layer, on the first forward pass,
before any gradient). Not seen by either check: a parameter used outside any call of the module
that holds it (``h @ emb.weight.T`` in a parent's forward); Opacus's ghost norms leave that use out,
so such a model needs ``PhantomClipping``, whose guard refuses it on every step. Both clip with ``engine.coefficients``: by default
the classic c_i = min(1, C / (||g_i|| + 1e-6)); ``rule="automatic"`` C / (||g_i|| + gamma).

Opacus records activations in training mode only: call ``model.train()`` (with dropout off where a
comparison must be exact). Inputs that reach an embedding must be contiguous (Opacus views them).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
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


@contextlib.contextmanager
def _calls(model: nn.Module) -> Iterator[dict[str, int]]:
    """Within the block, how many times each module holding a trainable parameter is called: one
    called twice (a table used as input lookup and output layer by one module, a layer reused inside
    a block) uses its parameters twice. Opacus 1.6 refuses its own Linear and Embedding called twice
    and, for other layers, sums per-call per-example gradients; ``Ghost`` refuses every layer called
    twice alike, as the seqrec engine it replaces refused the tied model, rather than depend on which
    of Opacus's paths a layer takes."""
    calls: dict[str, int] = {}

    def count(name: str):
        return lambda module, args, out: calls.__setitem__(name, calls.get(name, 0) + 1)

    handles = [m.register_forward_hook(count(name)) for name, m in model.named_modules()
               if any(p.requires_grad for p in m.parameters(recurse=False))]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _quiet() -> None:
    """Torch's warnings on Opacus's hooks that say nothing here: integer inputs need no gradient, so its
    full backward hooks see outputs only; CPU autocast's notes on its dtypes."""
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="In CPU autocast")


class PerSample:
    """Opacus's hooks mode: per-example gradients, then their clipped sum."""

    private = True

    def __init__(self, model: nn.Module, C: float, rule: str = "classic", gamma: float = 0.01):
        from opacus import GradSampleModule

        _quiet()
        self.C, self.rule, self.gamma = float(C), str(rule), float(gamma)
        self.gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any):
        self.gsm.zero_grad(set_to_none=True)
        losses = loss_fn(self.gsm, batch)
        losses.sum().backward()
        grads = [p.grad_sample for p in self.params]
        norms = torch.stack([g.flatten(1).square().sum(1) for g in grads]).sum(0).sqrt()
        c = coefficients(norms, C=self.C, rule=self.rule, gamma=self.gamma)
        for p, g in zip(self.params, grads):
            p.grad = torch.einsum("n,n...->...", c, g)
            p.grad_sample = None
        return losses.detach(), norms.detach()


class Ghost:
    """Opacus's fast gradient clipping: per-example norms without per-example gradients, the clipped
    sum by a second backward pass of sum_i c_i L_i."""

    private = True

    def __init__(self, model: nn.Module, C: float, rule: str = "classic", gamma: float = 0.01):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        tied = shared_parameters(model)
        if tied:
            raise Unsupported(f"Opacus's ghost clipping cannot clip a parameter used twice ({tied[0]} is tied): "
                              "use PhantomClipping, or untie the model")
        _quiet()
        self.C, self.rule, self.gamma = float(C), str(rule), float(gamma)
        self.model = model
        self.gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="sum",
                                                        max_grad_norm=self.C, use_ghost_clipping=True)

    def step(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any):
        self.gsm.zero_grad(set_to_none=True)
        advice = "use PhantomClipping, or a model that calls each layer once"
        with _calls(self.model) as calls:
            try:
                losses = loss_fn(self.gsm, batch)
            except NotImplementedError as err:  # Opacus's own refusal: one of its layers called a second time
                if "tying" not in str(err):
                    raise
                self.gsm._close()  # its hooks off the caller's model
                raise Unsupported(f"Opacus's ghost clipping cannot clip a parameter used twice ({err}): {advice}") from None
        twice = {name: k for name, k in calls.items() if k > 1}
        if twice:  # refused whatever Opacus would do with it (see _calls)
            self.gsm._close()
            name, k = next(iter(twice.items()))
            raise Unsupported(f"Opacus's ghost clipping cannot clip a parameter used twice ({name or 'the model'} "
                              f"was called {k} times in one forward pass, its parameters with it): {advice}")
        losses.sum().backward(retain_graph=True)
        norms = self.gsm.get_norm_sample().detach()
        c = coefficients(norms, C=self.C, rule=self.rule, gamma=self.gamma)
        self.gsm.zero_grad(set_to_none=True)
        self.gsm.disable_hooks()
        try:
            (c * losses).sum().backward()
        finally:
            self.gsm.enable_hooks()
        return losses.detach(), norms
