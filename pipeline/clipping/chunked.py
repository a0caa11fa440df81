"""A tied output layer and its cross-entropy over the vocabulary in chunks (issue 76): no (n, T, V)
tensor in the forward pass, the backward pass, or the engine's per-example quantities.

**The loss.** ``chunked_cross_entropy(h, W, y)``: per-token losses lse_t - h_t . W[y_t] of the logits
z_t = W h_t, the log-sum-exp taken over the vocabulary a chunk of rows at a time (a running maximum
and sum, as Liger's fused linear cross-entropy and Apple's Cut Cross-Entropy do). Its backward pass
forms each chunk's probabilities again from the saved log-sum-exp: dL/dh_t = g_t (sum_v p_tv W_v -
W[y_t]), dL/dW = sum_t g_t (p_t - e_{y_t}) h_t^T, a chunk of rows at a time.

**The per-example quantities** (``HeadUse``). One example's gradient of W from the head is
G_i = sum_t l_t h_t^T with l_t = g_t (p_t - e_{y_t}) (V long, never formed whole). Its inner products:

* with itself: sum_{t,s} (l_t . l_s)(h_t . h_s), where l_t . l_s = g_t g_s (p_t . p_s - p_t[y_s] -
  p_s[y_t] + [y_t = y_s]): p_t . p_s over the chunks (T x T per example), p_t[y_s] = exp(h_t . W[y_s]
  - lse_t) from the T targets' rows alone;
* with an embedding lookup of the same table (ids_s, output gradients r_s: the tie's cross term):
  sum_{t,s} l_t[id_s] (h_t . r_s), l_t[id_s] = g_t (exp(h_t . W[id_s] - lse_t) - [y_t = id_s]): the
  looked-up rows alone, no chunk loop;
* with a dense use of the table's rows (another linear call on it): over the chunks.

The clipped sum sum_i c_i G_i: a chunk of rows at a time, the targets' rows subtracted by index.
Exact against the whole-logits computation and a float64 brute force (tests/test_chunked_head.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from pipeline.clipping import layers
from pipeline.clipping.guard import Unsupported
from pipeline.clipping.uses import Outer

IGNORE = -100  # the targets that carry no loss (PyTorch's cross_entropy default ignore_index)


def _chunks(V: int, chunk: int):
    for start in range(0, V, chunk):
        yield start, min(V, start + chunk)


def logsumexp(h: torch.Tensor, W: torch.Tensor, chunk: int) -> torch.Tensor:
    """(N,) log sum_v exp(h_t . W_v), over ``chunk`` rows of W at a time (a running maximum and sum)."""
    return _scan(h, W, chunk)[0]


def _scan(h: torch.Tensor, W: torch.Tensor, chunk: int, expected: bool = False, groups: int = 0):
    """One pass over the vocabulary, ``chunk`` rows of W at a time, each sum kept relative to a running
    maximum m_t (rescaled by exp(m_old - m_new) when it rises): the log-sum-exp lse_t (N,); with
    ``expected``, E_t = sum_v p_tv W_v (N, d), which makes the input's gradient g_t (E_t - W[y_t]) with
    no pass in the backward; with ``groups`` k > 0, the probabilities' Gram p_t . p_s within each of k
    groups of N / k consecutive rows (k, N / k, N / k), the engine's per-example Gram (``HeadUse``).
    None for what was not asked."""
    N = h.shape[0]
    top = torch.full((N,), float("-inf"), dtype=h.dtype, device=h.device)
    total = torch.zeros(N, dtype=h.dtype, device=h.device)
    E = torch.zeros_like(h) if expected else None
    S = torch.zeros(groups, N // groups, N // groups, dtype=h.dtype, device=h.device) if groups else None
    for start, stop in _chunks(W.shape[0], chunk):
        z = h @ W[start:stop].T
        new = torch.maximum(top, z.max(1).values)
        scale = torch.exp(top - new)
        e = z.sub_(new[:, None]).exp_()  # in place: one (N, chunk) buffer a chunk
        total = total * scale + e.sum(1)
        if E is not None:
            E = E * scale[:, None] + e @ W[start:stop]
        if S is not None:
            es, sc = e.view(groups, N // groups, -1), scale.view(groups, -1)
            S = S * (sc[:, :, None] * sc[:, None, :]) + es @ es.transpose(1, 2)
        top = new
        del z, e  # freed before the next chunk's buffer is made
    if E is not None:
        E = E / total[:, None]
    if S is not None:
        t = total.view(groups, -1)
        S = S / (t[:, :, None] * t[:, None, :])
    return top + torch.log(total), E, S


def _wanted(node) -> bool:
    """Whether the running backward pass reaches ``node`` (the table's gradient accumulator): the
    engine's pass to the layers' outputs does not, and its table gradient is then never formed."""
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):  # no such query in this torch, or outside a backward pass
        return True


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, W, y, chunk, train, groups, node):
        keep = y != IGNORE
        target = torch.where(keep, y, torch.zeros_like(y))
        lse, E, pp = _scan(h, W, chunk, expected=train and ctx.needs_input_grad[0], groups=groups if train else 0)
        loss = (lse - (h * W[target]).sum(1)) * keep.to(h.dtype)
        ctx.save_for_backward(h, W, target, keep, lse, E if E is not None else h.new_zeros(0))
        ctx.chunk, ctx.node = chunk, node
        pp = pp if pp is not None else h.new_zeros(0)
        ctx.mark_non_differentiable(lse, pp)
        return loss, lse, pp

    @staticmethod
    def backward(ctx, g, _lse, _pp):
        h, W, target, keep, lse, E = ctx.saved_tensors
        g = g * keep.to(g.dtype)
        dh = dW = None
        if ctx.needs_input_grad[0]:  # E was formed in the forward pass (it needed h's gradient)
            dh = g[:, None] * (E - W[target])
        if ctx.needs_input_grad[1] and _wanted(ctx.node):
            dW = torch.zeros_like(W)
            for start, stop in _chunks(W.shape[0], ctx.chunk):
                d = (h @ W[start:stop].T).sub_(lse[:, None]).exp_().mul_(g[:, None])  # g_t p_t, one buffer
                dW[start:stop].addmm_(d.T, h)
                del d
            dW.index_add_(0, target, -g[:, None] * h)
        return dh, dW, None, None, None, None, None


def _apply(h: torch.Tensor, W: torch.Tensor, y: torch.Tensor, chunk: int, gram: bool = False):
    """The per-token losses shaped as ``y``, their log-sum-exps (N,) and, with ``gram`` and ``y`` of
    two or more dimensions, the probabilities' Gram within each ``y.shape[0]`` group (``_scan``)."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    shape = y.shape
    train = torch.is_grad_enabled() and (h.requires_grad or W.requires_grad)
    groups = shape[0] if gram and len(shape) >= 2 and shape[0] > 0 else 0
    node = get_gradient_edge(W).node if train and W.requires_grad else None
    loss, lse, pp = _ChunkedCE.apply(h.reshape(-1, h.shape[-1]), W, y.reshape(-1), int(chunk), train, groups, node)
    return loss.reshape(shape), lse, pp


def chunked_cross_entropy(h: torch.Tensor, W: torch.Tensor, y: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """Per-token cross-entropy losses of the logits h W^T against ``y`` (``IGNORE``: no loss), shaped as
    ``y``; ``h`` is (..., d), W (V, d). No (..., V) tensor is formed: ``chunk`` rows of W at a time, one
    pass over the vocabulary in the forward (the log-sum-exp and the input's gradient direction) and
    one in the backward (the table's gradient, where the pass needs it)."""
    return _apply(h, W, y, chunk)[0]


class HeadUse:
    """One call of the chunked head on n examples of T tokens: G_i = sum_t l_t h_t^T (the module's
    docstring), from ``h`` (n, T, d), the targets ``y`` (n, T), the per-token loss gradients ``g``
    (n, T) and the table ``W`` (V, d)."""

    def __init__(self, h: torch.Tensor, y: torch.Tensor, g: torch.Tensor, W: torch.Tensor, chunk: int,
                 lse: torch.Tensor | None = None, pp: torch.Tensor | None = None):
        self.keep = y != IGNORE
        self.h, self.W, self.chunk = h, W, int(chunk)
        self.y = torch.where(self.keep, y, torch.zeros_like(y))
        self.g = g.to(h.dtype) * self.keep.to(h.dtype)
        n, T, d = h.shape
        # the forward pass's own (``_PackedLoss``), or a pass over the vocabulary here
        self.lse = (lse if lse is not None else logsumexp(h.reshape(-1, d), W, self.chunk)).view(n, T)
        self._pp = pp  # p_t . p_s (n, T, T), formed in the forward pass, or None (``left_gram``'s pass)

    @property
    def rows(self) -> int:
        return self.W.shape[0]

    def _probs(self, start: int, stop: int) -> torch.Tensor:
        """(n, T, stop - start): p_t on rows start..stop - 1."""
        return (self.h @ self.W[start:stop].T).sub_(self.lse[..., None]).exp_()

    def _p_at(self, ids: torch.Tensor) -> torch.Tensor:
        """(n, T, S): p_t[ids_s], each example's probabilities at the S rows ``ids`` (n, S) name."""
        return torch.exp(self.h @ self.W[ids].transpose(1, 2) - self.lse[..., None])

    def left_gram(self) -> torch.Tensor:
        """(n, T, T): l_t . l_s."""
        pp = self._pp
        if pp is None:
            pp = torch.zeros(self.h.shape[0], self.h.shape[1], self.h.shape[1], dtype=self.h.dtype, device=self.h.device)
            for start, stop in _chunks(self.rows, self.chunk):
                p = self._probs(start, stop)
                pp += p @ p.transpose(1, 2)
        at = self._p_at(self.y)  # p_t[y_s]
        same = (self.y[:, :, None] == self.y[:, None, :]).to(self.h.dtype)
        return self.g[:, :, None] * self.g[:, None, :] * (pp - at - at.transpose(1, 2) + same)

    def sq_norm(self) -> torch.Tensor:
        """(n,): ||G_i||^2."""
        return (self.left_gram() * (self.h @ self.h.transpose(1, 2))).sum((1, 2))

    def with_lookup(self, ids: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        """(n,): <G_i, E_i> for an embedding lookup of the same table, E_i = sum_s e_{ids_s} right_s^T."""
        left = self.g[..., None] * (self._p_at(ids) - (self.y[:, :, None] == ids[:, None, :]).to(self.h.dtype))
        return (left * (self.h @ right.transpose(1, 2))).sum((1, 2))

    def _left(self, start: int, stop: int) -> torch.Tensor:
        """(n, T, stop - start): l_t on rows start..stop - 1."""
        p = self._probs(start, stop)
        at = (self.y >= start) & (self.y < stop)  # the targets among these rows: p_t - e_{y_t} there
        p[at, self.y[at] - start] -= 1
        return p.mul_(self.g[..., None])

    def _dense_gram(self, left: torch.Tensor, start: int) -> torch.Tensor:
        """(n, T, S): l_t . b_s for a dense left factor ``left`` (n, S, W) on rows start..start + W - 1."""
        out = torch.zeros(self.h.shape[0], self.h.shape[1], left.shape[1], dtype=self.h.dtype, device=self.h.device)
        stop = start + left.shape[-1]
        for a, b in _chunks(self.rows, self.chunk):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                out += self._left(lo, hi) @ left[..., lo - start:hi - start].to(self.h.dtype).transpose(1, 2)
        return out

    def inner(self, other, n: int, shape) -> torch.Tensor:
        """(n,): <G_i, G'_i> with another use of the table (``pipeline.clipping.uses.inner``)."""
        if other is self:
            return self.sq_norm()
        if isinstance(other, HeadUse):
            gram = torch.zeros(n, self.h.shape[1], other.h.shape[1], dtype=self.h.dtype, device=self.h.device)
            for a, b in _chunks(self.rows, self.chunk):
                gram += self._left(a, b) @ other._left(a, b).transpose(1, 2)
            return (gram * (self.h @ other.h.transpose(1, 2).to(self.h.dtype))).sum((1, 2))
        if isinstance(other, Outer) and other.rows == self.rows:
            right = other.right.to(self.h.dtype)
            if other.index:
                return self.with_lookup(other.left, right)
            return (self._dense_gram(other.left, other.span[0]) * (self.h @ right.transpose(1, 2))).sum((1, 2))
        raise Unsupported("the chunked output layer's table is also used by a layer whose per-example gradient is "
                          "given whole (a Direct use): its inner product with the chunked head is not implemented")

    def weighted_sum(self, c: torch.Tensor) -> torch.Tensor:
        """(V, d): sum_i c_i G_i, a chunk of rows at a time."""
        n, T, d = self.h.shape
        w = (c.to(self.h.dtype)[:, None] * self.g).reshape(-1)  # c_i g_t per token
        h = self.h.reshape(-1, d)
        lse = self.lse.reshape(-1)
        out = torch.zeros_like(self.W)
        for start, stop in _chunks(self.rows, self.chunk):
            d = (h @ self.W[start:stop].T).sub_(lse[:, None]).exp_().mul_(w[:, None])  # one (nT, chunk) buffer
            out[start:stop].addmm_(d.T, h)
            del d
        return out.index_add_(0, self.y.reshape(-1), -w[:, None] * h)


class _Saved(NamedTuple):
    """One forward call's log-sum-exps and probabilities' Gram, for the engine's reading of that call."""
    packed: torch.Tensor  # the call's input, detached (held: its memory is not reused while it is kept)
    version: int  # its version counter then: a later write makes the entry another call's
    weight_version: int
    lse: torch.Tensor
    pp: torch.Tensor


class _PackedLoss(nn.Module):
    """The chunked loss on (..., d + 1) inputs, the hidden states with the targets as a last column (the
    engine hands a registered layer its first input only): the registered function reads both.

    Once the engine has read it (``gram``, set by the registered function), each training forward call
    also forms the per-example probabilities' Gram in its one pass over the vocabulary and keeps it with
    the log-sum-exps until the engine reads that call (``take``): the engine's per-example norms then
    cost no pass of their own. A call the engine reads in another layout, or after a write, is read by
    ``HeadUse``'s own passes (same numbers)."""

    KEEP = 4  # calls kept at most (a forward pass that calls the head more than once; calls never read)

    def __init__(self, weight: nn.Parameter, chunk: int):
        super().__init__()
        self.weight, self.chunk = weight, int(chunk)
        self.gram = False
        self._saved: list[_Saved] = []

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        h, y = packed[..., :-1], packed[..., -1].round().long()
        loss, lse, pp = _apply(h, self.weight.to(h.dtype), y, self.chunk, gram=self.gram)
        if pp.numel():
            self._saved = [*self._saved[-(self.KEEP - 1):], _Saved(packed.detach(), packed._version, self.weight._version,
                                                                   lse, pp)]
        return loss

    def take(self, x: torch.Tensor, n: int) -> _Saved | None:
        """The kept call whose input ``x`` is, element for element, with its examples first as the
        Gram's groups (n of them), removed from the kept; None if there is none."""
        for i, s in enumerate(self._saved):
            if (s.packed.data_ptr() == x.data_ptr() and s.packed.shape == x.shape and s.packed.stride() == x.stride()
                    and s.packed.dtype == x.dtype and s.packed.device == x.device and s.version == x._version
                    and s.weight_version == self.weight._version and s.pp.shape[0] == n):
                return self._saved.pop(i)
        return None


@layers.register(_PackedLoss)
def _packed_loss(layer: _PackedLoss, x: torch.Tensor, g: torch.Tensor, n: int):
    """The head's use of the table: ``HeadUse`` (never the (n, T, V) left factor), with the forward
    call's log-sum-exps and Gram where it kept them."""
    h, y = x[..., :-1], x[..., -1].round().long()
    d = h.shape[-1]
    saved = layer.take(x, n)
    layer.gram = True
    h = h.reshape(n, -1, d)
    return [(layer.weight, HeadUse(h, y.reshape(n, -1), g.reshape(n, -1), layer.weight.detach().to(h.dtype),
                                   layer.chunk, lse=saved.lse if saved else None, pp=saved.pp if saved else None))]


class ChunkedTiedHead(nn.Module):
    """The output layer tied to ``embedding`` (its weight, the same Parameter) and the per-token
    cross-entropy, over the vocabulary ``chunk`` rows at a time: ``head(h, targets)`` returns the
    (..., T) losses of the logits h W^T (targets ``IGNORE``: 0), and no (..., V) tensor exists in the
    forward or backward pass or in the clipping engine's per-example norms. Replace a model's
    ``lm_head`` and its loss by it (docs/clipping.md). The targets travel in the loss layer's input as
    a column of h's dtype (float32 at least: exact below 2^24 targets)."""

    def __init__(self, embedding: nn.Embedding, chunk: int = 8192):
        super().__init__()
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        self.loss = _PackedLoss(embedding.weight, chunk)

    @property
    def weight(self) -> nn.Parameter:
        return self.loss.weight

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(h.dtype, torch.float32)
        packed = torch.cat([h.to(dtype), targets.unsqueeze(-1).to(dtype)], -1)
        return self.loss(packed)
