"""Layers without a registered function of their own, handled exactly all the same:

* a subclass of a registered layer type whose ``forward`` does more than the base (a scaled word
  embedding, ``super().forward(ids) * sqrt(d)``; a learned position embedding with an offset,
  ``super().forward(positions + 2)``): the call of the base's functional form on the layer's own
  weight (``F.embedding(ids, self.weight, ...)``, ``F.linear(x, self.weight, self.bias)``) is
  recorded while the layer runs (a ``TorchFunctionMode`` active during its call only), and the base's
  function reads it; what the subclass does around it is ordinary graph, walked by the guard;
* any other layer (the many RMSNorm and LayerNorm variants of Hugging Face's families: T5's, Gemma's
  ``(1 + w)``; a ``Conv1d``; an attention holding a bare bias or sink vector): each example's gradient
  of the parameters it holds itself by ``torch.func``, the vector-Jacobian product of the layer's own
  forward on that example's rows, vectorised over the examples. Exact (it is autograd), and checked
  on every call: the examples' gradients must add up to the batch's, or the layer mixes the examples
  of a batch and is refused. It materialises those per-example gradients (n times the parameters'
  size): cheap for norms and small convolutions, as costly as Opacus's hooks for a large matrix
  (register a function for such a layer).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call reparametrises with
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from pipeline.clipping import layers
from pipeline.clipping.guard import Unsupported
from pipeline.clipping.uses import Direct


def _embedding_call(layer, args, kwargs):
    """F.embedding(input, weight, padding_idx=None, ...) on the layer's weight: (input, a stand-in layer)."""
    named = dict(zip(("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq"), args))
    named.update(kwargs)
    if named.get("weight") is not layer.weight:
        return None
    if named.get("max_norm") is not None or named.get("scale_grad_by_freq"):
        raise Unsupported(f"{type(layer).__name__} calls F.embedding with max_norm or scale_grad_by_freq: its rows "
                          "are renormalised or its gradient scaled by the whole batch's counts, no per-example gradient")
    padding = named.get("padding_idx")
    if padding is not None and padding < 0:
        padding += layer.weight.shape[0]
    return named["input"], SimpleNamespace(weight=layer.weight, padding_idx=padding,
                                           num_embeddings=layer.weight.shape[0]), layers.embedding


def _linear_call(layer, args, kwargs):
    """F.linear(input, weight, bias=None) on the layer's weight."""
    named = dict(zip(("input", "weight", "bias"), args))
    named.update(kwargs)
    if named.get("weight") is not layer.weight:
        return None
    bias = named.get("bias")
    if bias is not None and bias is not getattr(layer, "bias", None):
        return None
    return named["input"], SimpleNamespace(weight=layer.weight, bias=bias, out_features=layer.weight.shape[0]), \
        layers.linear


BASES = ((nn.Embedding, F.embedding, _embedding_call), (nn.Linear, F.linear, _linear_call))


def base_of(module: nn.Module):
    """(base type, its functional form, reader) for a subclass of a registered base layer type, else None."""
    for base, fn, reader in BASES:
        if isinstance(module, base) and type(module) is not base:
            return base, fn, reader
    return None


class Capture(TorchFunctionMode):
    """Active while one subclassed layer runs: each call of its base's functional form on its own
    weight is handed to ``note(layer, x, output, fn, tensors)`` (``fn(layer, x, g, n)`` the base's
    function on the call's stand-in layer; ``tensors`` the call's other tensor arguments), whose
    return value (the output, or the output expanded over the batch) is what the layer goes on with."""

    def __init__(self, layer: nn.Module, note: Callable):
        super().__init__()
        self.layer, self.note = layer, note
        _, self.fn, self.reader = base_of(layer)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is self.fn and isinstance(out, torch.Tensor) and out.requires_grad:
            found = self.reader(self.layer, args, kwargs)
            if found is not None:
                x, stand_in, function = found
                out = self.note(self.layer, x, out, lambda layer, x, g, n: function(stand_in, x, g, n),
                                [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)
                                 and t is not self.layer.weight and t is not getattr(self.layer, "bias", None)])
        return out


def rounding(dtype: torch.dtype, terms: int) -> float:
    """A relative tolerance for two sums of ``terms`` products taken in different orders: rounding's
    random walk, 16 eps sqrt(terms) (eps of ``dtype``: 1.2e-7 in float32, 2.2e-16 in float64)."""
    return 16 * torch.finfo(dtype).eps * math.sqrt(max(1, terms))


def bare_call(layer: nn.Module, params: dict, args: tuple, kwargs: dict):
    """The layer's own forward on ``params`` (by name), without the layer's hooks: the engine records a
    call before any forward hook of the layer runs (and its arguments after its pre-hooks), so a hook's
    effect is outside the call, walked as graph; ``torch.func.functional_call`` would run the hooks again.
    The hooks of the layers inside it run, as they did in the step's forward pass."""
    with _reparametrize_module(layer, params, tie_weights=True):  # as functional_call: a tied name moves all
        return layer.forward(*args, **kwargs)


def _pick(out, which):
    return out if which is None else out[which]


def per_example(layer: nn.Module, args: tuple, kwargs: dict, g: torch.Tensor, n: int, which: int | None,
                names: list[str], layouts: list | None = None, g_layout=None):
    """[(parameter, Direct (n, P, Q))] for each parameter of ``names``, relative to the layer (its own
    trainable ones, or some of them, and those of a sublayer its forward uses directly): the
    vector-Jacobian product of the layer's forward on each example's part of the call with that example's
    output gradient, vectorised over the examples (``torch.func.vmap``; one example at a time where vmap
    cannot run the forward: an autograd.Function, a value read on the host). ``args``/``kwargs`` are the
    call's, detached. ``layouts`` (one per tensor of the flattened ``(args, kwargs)``) and ``g_layout``
    say where the examples are (``provenance.Layout``): each example's part of a tensor is its slice, with
    the examples' dimension kept (of size outer x inner: 1 for a batch-first tensor); a tensor of None is
    shared by the examples; ``g_layout`` None with ``layouts`` given: ``g`` is (n, *output shape), a call
    every example shares. Without ``layouts`` (a step of one example) every tensor whose leading size is
    the output's is split as one example's rows. ``which``: the recorded element of a layer that returns a
    tuple. Each example's gradient of these parameters is materialised (n times their size): exact, and as
    costly as Opacus's per-example gradients for that layer. Checked: the examples' gradients add up to
    the batch's (a layer that mixes the examples has no per-example gradient)."""
    from torch.func import vjp, vmap

    params = [layer.get_parameter(k) for k in names]
    values = tuple(p.detach() for p in params)
    flat, spec = tree_flatten((args, kwargs))
    if layouts is None:
        rows = g.shape[0]
        dims = [0 if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows else None for t in flat]
        per = [t.reshape(n, rows // n, *t.shape[1:]) if d == 0 else t for t, d in zip(flat, dims)]
        shapes = [None] * len(flat)
        gs, g_dim, g_shape = g.reshape(n, rows // n, *g.shape[1:]), 0, None
    else:
        dims, per, shapes = [], [], []
        for t, layout in zip(flat, layouts):
            if layout is None or not isinstance(t, torch.Tensor):
                dims.append(None), per.append(t), shapes.append(None)
                continue
            b, outer, inner = layout
            dims.append(b + 1)
            per.append(t.reshape(*t.shape[:b], outer, n, inner, *t.shape[b + 1:]))
            shapes.append((*t.shape[:b], outer * inner, *t.shape[b + 1:]))
        if g_layout is None:
            gs, g_dim, g_shape = g, 0, None
        else:
            b, outer, inner = g_layout
            gs, g_dim = g.reshape(*g.shape[:b], outer, n, inner, *g.shape[b + 1:]), b + 1
            g_shape = (*g.shape[:b], outer * inner, *g.shape[b + 1:])

    def whole(inputs, grad):  # an example's part, back to the call's rank
        inputs = [t.reshape(s) if s is not None else t for t, s in zip(inputs, shapes)]
        return inputs, grad.reshape(g_shape) if g_shape is not None else grad

    def pull(params, inputs, grad):
        inputs, grad = whole(inputs, grad)
        a, k = tree_unflatten(list(inputs), spec)

        def forward(*v):
            out = bare_call(layer, dict(zip(names, v)), a, k)
            return out if which is None else out[which]

        _, back = vjp(forward, *params)
        return back(grad)

    def plain(inputs, grad):  # torch.autograd, not torch.func: any autograd.Function runs
        inputs, grad = whole(inputs, grad)
        a, k = tree_unflatten(list(inputs), spec)
        leaves = [v.clone().requires_grad_(True) for v in values]
        with torch.enable_grad():
            out = bare_call(layer, dict(zip(names, leaves)), a, k)
            out = out if which is None else out[which]
            found = torch.autograd.grad(out, leaves, grad, allow_unused=True)
        return tuple(torch.zeros_like(v) if f is None else f for v, f in zip(values, found))

    g_whole = g.sum(0) if layouts is not None and g_layout is None else g

    def pull_whole(values):
        _, back = vjp(lambda *v: _pick(bare_call(layer, dict(zip(names, v)), *tree_unflatten(flat, spec)), which),
                      *values)
        return back(g_whole)

    def plain_whole():
        leaves = [v.clone().requires_grad_(True) for v in values]
        with torch.enable_grad():
            out = _pick(bare_call(layer, dict(zip(names, leaves)), *tree_unflatten(flat, spec)), which)
            found = torch.autograd.grad(out, leaves, g_whole, allow_unused=True)
        return tuple(torch.zeros_like(v) if f is None else f for v, f in zip(values, found))

    try:
        try:
            grads = vmap(pull, in_dims=(None, dims, g_dim))(values, per, gs)
            totals = pull_whole(values)  # the batch's gradient in one piece
        except (RuntimeError, ValueError, TypeError, NotImplementedError):  # one example at a time
            each = [plain([t.select(d, i) if d is not None else t for t, d in zip(per, dims)], gs.select(g_dim, i))
                    for i in range(n)]
            grads = tuple(torch.stack(found) for found in zip(*each))
            totals = plain_whole()
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise Unsupported(f"layer {type(layer).__name__} has no registered function, and torch.func could not run its "
                          f"forward one example at a time ({first}): register a function for it "
                          "(pipeline.clipping.register) or freeze it") from error
    for name, each, total in zip(names, grads, totals):
        each, total = each.detach(), total.detach()
        summed = each.sum(0)
        scale = float(each.abs().sum()) + float(total.abs().sum())
        # at float32's rounding at least: Hugging Face's norms compute in float32 whatever the input's dtype
        if float((summed - total).abs().sum()) > rounding(torch.float32, g.numel()) * max(scale, 1e-300):
            raise Unsupported(
                f"layer {type(layer).__name__} has no registered function, and the gradients of its {name} computed "
                "one example at a time do not add up to the batch's: its forward mixes the examples of a batch (or "
                "draws randomness per call), so no per-example gradient exists; register a function for it "
                "(pipeline.clipping.register) or freeze it")
    return [(p, Direct(grad=each.reshape(n, 1, p.numel()) if p.dim() <= 1 or p.numel() == 0
                       else each.reshape(n, p.shape[0], -1))) for p, each in zip(params, grads)]
