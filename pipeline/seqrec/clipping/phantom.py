"""Phantom Clipping: the clipped sum of per-user gradients without per-user gradients.

One forward pass records, for every layer with a norm function (``norms.NORMS``), its input at
every call and hooks its output's gradient. One backward pass, ``autograd.grad`` of the summed
per-user losses with respect to the embedding lookups' outputs only (no parameter gradient is
formed), fills every layer's output gradients; each layer's norm function turns (inputs, output gradients) into per-user squared
norms, the tied item table's including the cross term between its input and output uses. The
clipped sum is then a second backward pass through the same graph (same dropout masks) of
sum_i c_i L_i, with c_i the clipping coefficient of user i's total norm (``sum_by: backward``), or
book-keeping (``sum_by: bookkeeping``): each layer's clipped gradient formed directly from the
recorded inputs and output gradients weighted by c_i (``norms.SUMS``), no second pass.
"""

from __future__ import annotations

import torch

from pipeline.seqrec.clipping.norms import NORMS, SUMS
from pipeline.seqrec.models import user_losses


def owners(model: torch.nn.Module) -> dict[torch.nn.Module, list[torch.nn.Parameter]]:
    """The layers that own the model's trainable parameters, each of a type with a norm function.
    A parameter held by two layers would need a cross term no single norm function sees (fastDP's
    shared-embedding bug): refused, as is a parameter in a layer of an unknown type."""
    seen: dict[int, str] = {}
    found = {}
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        if type(module) not in NORMS:
            raise TypeError(f"layer {name} ({type(module).__name__}) has no per-user norm function")
        for p in params:
            if id(p) in seen:
                raise TypeError(f"a parameter of {name} is also held by {seen[id(p)]}: tie it in one layer")
            seen[id(p)] = name
        found[module] = params
    missing = {id(p) for p in model.parameters() if p.requires_grad} - set(seen)
    if missing:
        raise TypeError(f"{len(missing)} trainable parameters are not in any layer with a norm function")
    return found


SUM_BY = ("bookkeeping", "backward")


class Phantom:
    private = True

    def __init__(self, model, coef, form: str = "auto", sum_by: str = "bookkeeping"):
        if sum_by not in SUM_BY:
            raise ValueError(f"unknown sum_by {sum_by!r}; known: {SUM_BY}")
        self.model, self.coef, self.form, self.sum_by = model, coef, form, sum_by
        self.layers = owners(model)
        if sum_by == "bookkeeping":
            missing = {type(m).__name__ for m in self.layers if type(m) not in SUMS}
            if missing:
                raise TypeError(f"no book-keeping sum for {sorted(missing)}: use sum_by=backward")
        self._calls: dict[torch.nn.Module, list] = {}
        for module in self.layers:
            module.register_forward_hook(self._record)

    def _record(self, module, inputs, output):
        """Keep the layer's input and catch its output gradient with a tensor hook; the output itself
        is not kept (the n x T x M scores would otherwise outlive the loss). Outputs of layers fed by
        no gradient-carrying input (the embedding lookups) are the sources the backward pass runs to."""
        if not (torch.is_grad_enabled() and self._active):
            return
        slot = [inputs[0].detach(), None, output.shape, output.dtype]
        self._calls.setdefault(module, []).append(slot)
        if output.requires_grad:
            output.register_hook(lambda g, slot=slot: slot.__setitem__(1, g))
            if not inputs[0].requires_grad:
                self._sources.append(output)

    _active = False

    def per_user_sq_norms(self, ids, targets):
        """Forward, per-user losses (n,), per-user squared norms (n,) of the whole model's gradient."""
        losses, sq, _ = self._norms(ids, targets)
        return losses, sq

    def _norms(self, ids, targets):
        self._calls, self._sources = {}, []
        self._active = True
        try:
            losses = user_losses(self.model(ids), ids, targets)
        finally:
            self._active = False
        # gradients w.r.t. the sources only: every recorded layer lies between them and the loss, so
        # its output hook fires, and no parameter gradient is formed
        torch.autograd.grad(losses.sum(), self._sources, retain_graph=self.sum_by == "backward", allow_unused=True)
        per_layer: dict[torch.nn.Module, list] = {}
        for m, recs in self._calls.items():
            per_layer[m] = [(a, torch.zeros(shape, dtype=dtype, device=a.device) if g is None else g)
                            for a, g, shape, dtype in recs]
        self._calls, self._sources = {}, []
        losses = losses.detach() if self.sum_by == "bookkeeping" else losses
        sq = losses.new_zeros(losses.shape[0])
        for m, layer_calls in per_layer.items():
            for value in NORMS[type(m)](m, layer_calls, self.form).values():
                sq = sq + value
        return losses, sq, per_layer

    def step(self, ids, targets):
        losses, sq, per_layer = self._norms(ids, targets)
        norms = sq.clamp(min=0).sqrt().detach()
        c = self.coef(norms)
        self.model.zero_grad()
        if self.sum_by == "backward":
            (c * losses).sum().backward()
        else:
            for m, layer_calls in per_layer.items():
                for p, g in SUMS[type(m)](m, layer_calls, c).items():
                    p.grad = g if p.grad is None else p.grad + g
        return losses.detach(), norms
