"""Per-user squared gradient norms of one layer, from what the layer saw (Opacus's NORM_SAMPLERS
pattern): ``NORMS[layer type](layer, calls) -> {parameter: (n,) squared norms}``.

``calls`` lists every call of the layer in the forward pass as (input, grad of the loss w.r.t.
the output), batch first. A layer called several times (a recurrent weight at every step, the
tied item table as input lookup and as output scores) gets all its calls at once, so the norm is
that of the *sum* of the calls' gradients, cross terms included: this is where Phantom Clipping
differs from an engine that handles each call, or each branch, on its own.

Adding a layer type is one function here and one ``@register`` line.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.seqrec.models import TiedEmbedding

NORMS: dict[type, Callable] = {}

# auto: the exact form with fewer flops: the Gram form <A A^T, G G^T> costs T^2 (i + o) per user,
# the layer's per-user gradient G^T A costs T i o (computed in chunks of users whose gradients stay
# under DIRECT_BUDGET floats); Gram wins when T (i + o) <= i o
MODES = ("auto", "gram", "direct")
DIRECT_BUDGET = 2**24


def register(layer_type: type):
    def wrap(fn):
        NORMS[layer_type] = fn
        return fn
    return wrap


def _tokens(t: torch.Tensor, n: int) -> torch.Tensor:
    """(n, ..., k) -> (n, tokens, k)."""
    return t.reshape(n, -1, t.shape[-1])


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)  # one call: a view, no copy


def _gather(calls, n: int):
    return _cat([_tokens(a, n) for a, _ in calls]), _cat([_tokens(g, n) for _, g in calls])


def gram_inner(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """||sum_t g_t a_t^T||_F^2 = <A A^T, G G^T> per user, for a (n, T, i), g (n, T, o)."""
    return ((a @ a.transpose(1, 2)) * (g @ g.transpose(1, 2))).sum((1, 2))


def direct_inner(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """||G^T A||_F^2 per user, instantiating one (o, i) gradient per user, in chunks of users."""
    n, _, i = a.shape
    o = g.shape[-1]
    chunk = max(1, DIRECT_BUDGET // max(1, i * o))
    return torch.cat([(g[s:s + chunk].transpose(1, 2) @ a[s:s + chunk]).square().sum((1, 2))
                      for s in range(0, n, chunk)]) if n else a.new_zeros(0)


def product_norm(a: torch.Tensor, g: torch.Tensor, mode: str) -> torch.Tensor:
    T, i, o = a.shape[1], a.shape[-1], g.shape[-1]
    use_gram = mode == "gram" or (mode == "auto" and T * (i + o) <= i * o)
    return gram_inner(a, g) if use_gram else direct_inner(a, g)


@register(nn.Linear)
def linear(layer: nn.Linear, calls, mode: str = "auto") -> dict:
    """Weight: ||sum_t g_t a_t^T||^2 (ghost norm over every token of every call); bias: ||sum_t g_t||^2."""
    n = calls[0][0].shape[0]
    a, g = _gather(calls, n)
    out = {layer.weight: product_norm(a.to(g.dtype), g, mode)}
    if layer.bias is not None:
        out[layer.bias] = g.sum(1).square().sum(1)
    return out


@register(nn.LayerNorm)
def layer_norm(layer: nn.LayerNorm, calls, mode: str = "auto") -> dict:
    """Per-user gradients are d-vectors, computed directly: weight sum_t g_t * xhat_t, bias sum_t g_t."""
    n = calls[0][0].shape[0]
    x, g = _gather(calls, n)
    xhat = F.layer_norm(x, layer.normalized_shape, eps=layer.eps)
    out = {}
    if layer.weight is not None:
        out[layer.weight] = (g * xhat).sum(1).square().sum(1)
    if layer.bias is not None:
        out[layer.bias] = g.sum(1).square().sum(1)
    return out


def _lookup_norm(ids: torch.Tensor, e: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    """||sum_s onehot(x_s) e_s^T||^2 = sum_{s,t} 1[x_s = x_t] <e_s, e_t> (padding rows excluded):
    an item repeated in a sequence adds its gradients up."""
    same = ids[:, :, None] == ids[:, None, :]
    if padding_idx is not None:
        keep = ids != padding_idx
        same = same & keep[:, :, None] & keep[:, None, :]
    return (same * (e @ e.transpose(1, 2))).sum((1, 2))


@register(nn.Embedding)
def embedding(layer: nn.Embedding, calls, mode: str = "auto") -> dict:
    n = calls[0][0].shape[0]
    ids = _cat([a.reshape(n, -1) for a, _ in calls])
    e = _cat([_tokens(g, n) for _, g in calls])
    return {layer.weight: _lookup_norm(ids, e, layer.padding_idx)}


@register(TiedEmbedding)
def tied_embedding(layer: TiedEmbedding, calls, mode: str = "auto") -> dict:
    """Phantom Clipping's norm of the shared item table E, exactly, without per-user M x d tensors.

    Per user, the gradient is grad_in + grad_out with grad_in = sum_s onehot(x_s) e_s^T (e_s: the
    loss gradient w.r.t. the looked-up embedding at input position s) and grad_out = G^T H on rows
    1..M (G: (T, M) loss gradient w.r.t. the scores, H: (T, d) the hidden states scored), so

        ||g_E||^2 = ||grad_in||^2 + ||grad_out||^2 + 2 <grad_in, grad_out>
        ||grad_in||^2  = sum_{s,t} 1[x_s = x_t] <e_s, e_t>           (x_s, x_t not padding)
        ||grad_out||^2 = <G G^T, H H^T>                              (or ||G^T H||^2 in user chunks)
        <grad_in, grad_out> = sum_{s,t} G[t, x_s] <e_s, h_t>          (G gathered at the input items)

    Two errors of the paper's Claim 4.1 (Eq. 4.1) are corrected here: (1) its first term is
    <a a^T, de de^T> squared, but that inner product already is the squared norm (B.3 writes it
    as the norm itself, also wrong by a square): squaring it again is dimensionally a fourth
    power; (2) its output-side terms ||de_c||^2 and <de_s, a_s^T de_c> use de_c, the per-user
    (M x d) gradient w.r.t. the candidate embeddings, i.e. the per-user M x d gradient Phantom
    Clipping claims to avoid; with de_c = G^T H they factor into the Gram form and the gather above,
    which need (T x T) and (T x S) tensors per user only.
    """
    n = calls[0][0].shape[0]
    looks = [(a, g) for a, g in calls if not a.is_floating_point()]
    outs = [(a, g) for a, g in calls if a.is_floating_point()]
    total = calls[0][1].new_zeros(n)
    if looks:
        ids = _cat([a.reshape(n, -1) for a, _ in looks])
        e = _cat([_tokens(g, n) for _, g in looks])
        total = total + _lookup_norm(ids, e, padding_idx=0)
    if outs:
        h, G = _gather(outs, n)
        total = total + product_norm(h, G, mode)
    if looks and outs:
        idx = (ids - 1).clamp(min=0)
        Gx = G.gather(2, idx[:, None, :].expand(n, G.shape[1], idx.shape[1]))  # Gx[t, s] = G[t, x_s]
        eh = h @ e.transpose(1, 2)  # <h_t, e_s>
        total = total + 2 * (Gx * eh * (ids != 0)[:, None, :]).sum((1, 2))
    return {layer.weight: total}


# ------------------------------------------------------------------------------------------------
# Book-keeping: the clipped sum sum_i c_i g_i of one layer from the same (input, output gradient)
# pairs, without a second backward pass: ``SUMS[layer type](layer, calls, c) -> {parameter: gradient}``.

SUMS: dict[type, Callable] = {}


def register_sum(layer_type: type):
    def wrap(fn):
        SUMS[layer_type] = fn
        return fn
    return wrap


def _weighted(g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return g * c.view(-1, *([1] * (g.dim() - 1)))


def _weighted_product(g: torch.Tensor, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """sum_i c_i G_i^T A_i for g (n, T, o), a (n, T, i), weighting the narrower of the two (the
    (n, T, M) score gradient is never copied)."""
    if a.shape[-1] <= g.shape[-1]:
        a = _weighted(a, c)
    else:
        g = _weighted(g, c)
    return g.reshape(-1, g.shape[-1]).T @ a.reshape(-1, a.shape[-1])


@register_sum(nn.Linear)
def linear_sum(layer: nn.Linear, calls, c) -> dict:
    n = calls[0][0].shape[0]
    a, g = _gather(calls, n)
    out = {layer.weight: _weighted_product(g, a.to(g.dtype), c)}
    if layer.bias is not None:
        out[layer.bias] = c @ g.sum(1)
    return out


@register_sum(nn.LayerNorm)
def layer_norm_sum(layer: nn.LayerNorm, calls, c) -> dict:
    n = calls[0][0].shape[0]
    x, g = _gather(calls, n)
    out = {}
    if layer.weight is not None:
        out[layer.weight] = c @ (g * F.layer_norm(x, layer.normalized_shape, eps=layer.eps)).sum(1)
    if layer.bias is not None:
        out[layer.bias] = c @ g.sum(1)
    return out


def _lookup_sum(weight: torch.Tensor, ids: torch.Tensor, e: torch.Tensor, c, padding_idx) -> torch.Tensor:
    grad = torch.zeros_like(weight).index_add_(0, ids.reshape(-1), _weighted(e, c).reshape(-1, e.shape[-1]))
    if padding_idx is not None:
        grad[padding_idx] = 0
    return grad


@register_sum(nn.Embedding)
def embedding_sum(layer: nn.Embedding, calls, c) -> dict:
    n = calls[0][0].shape[0]
    ids = _cat([a.reshape(n, -1) for a, _ in calls])
    e = _cat([_tokens(g, n) for _, g in calls])
    return {layer.weight: _lookup_sum(layer.weight, ids, e, c, layer.padding_idx)}


@register_sum(TiedEmbedding)
def tied_embedding_sum(layer: TiedEmbedding, calls, c) -> dict:
    """Input side: the weighted lookup gradients added at their items; output side: (c G)^T H on
    rows 1..M."""
    n = calls[0][0].shape[0]
    grad = torch.zeros_like(layer.weight)
    looks = [(a, g) for a, g in calls if not a.is_floating_point()]
    outs = [(a, g) for a, g in calls if a.is_floating_point()]
    if looks:
        ids = _cat([a.reshape(n, -1) for a, _ in looks])
        e = _cat([_tokens(g, n) for _, g in looks])
        grad = grad + _lookup_sum(layer.weight, ids, e, c, 0)
    if outs:
        h, G = _gather(outs, n)
        grad[1:] += _weighted_product(G, h, c)
    return {layer.weight: grad}
