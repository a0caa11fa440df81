"""One use of a parameter by one layer call, as the per-example gradient it contributes, and the
inner products between uses that make up a tied parameter's per-example squared norm.

A parameter W of shape (P, Q) (a vector: (1, Q)) used by a layer gets, from one call on a batch
of n examples, the per-example gradient G_i = sum_t left_it right_it^T (``Outer``): a linear layer
y = x W^T has left = dL/dy (P = outputs) and right = x (Q = inputs); an embedding lookup y = W[id]
has left = one-hot(id) (``Index``) and right = dL/dy. A parameter whose per-example gradient is no
outer product (a LayerNorm's weight) gives it whole (``Direct``: (n, P, Q)).

The per-example squared norm of a parameter used k times is ||sum_u G_i^u||^2 = sum_{u, v}
<G_i^u, G_i^v>: every use with itself and every cross term between two uses (the tied embedding's
input and output uses: Phantom Clipping). Each inner product is exact, in one of two forms with
the fewer operations: the Gram form sum_{t,s} (left_t . left'_s)(right_t . right'_s) costs about
T S (P + Q) per example, materialising both gradients about (T + S) P Q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_FLOATS = 2**24  # materialised per-example gradients are formed this many floats at a time


@dataclass
class Outer:
    """G_i = sum_t left[i, t] right[i, t]^T; ``left`` is (n, T, P) or, for ``index=True``, (n, T)
    row indices into P rows (a one-hot left factor); ``right`` is (n, T, Q)."""
    left: torch.Tensor
    right: torch.Tensor
    rows: int  # P
    index: bool = False

    @property
    def tokens(self) -> int:
        return self.right.shape[1]

    def dense(self, rows: slice) -> torch.Tensor:
        """The per-example gradients of examples ``rows``, (m, P, Q)."""
        right = self.right[rows]
        if not self.index:
            return self.left[rows].transpose(1, 2) @ right
        m, _, q = right.shape
        out = right.new_zeros(m, self.rows, q)
        return out.scatter_add_(1, self.left[rows].unsqueeze(-1).expand(-1, -1, q), right)

    def weighted_sum(self, c: torch.Tensor) -> torch.Tensor:
        """sum_i c_i G_i, (P, Q): the clipped sum by book-keeping (no second backward pass)."""
        right = (c.to(self.right.dtype).view(-1, 1, 1) * self.right).reshape(-1, self.right.shape[-1])
        if not self.index:
            return self.left.reshape(-1, self.rows).transpose(0, 1).to(right.dtype) @ right
        out = right.new_zeros(self.rows, right.shape[-1])
        return out.index_add_(0, self.left.reshape(-1), right)


@dataclass
class Direct:
    """G_i given whole, (n, P, Q)."""
    grad: torch.Tensor

    def dense(self, rows: slice) -> torch.Tensor:
        return self.grad[rows]

    def weighted_sum(self, c: torch.Tensor) -> torch.Tensor:
        return torch.einsum("n,npq->pq", c.to(self.grad.dtype), self.grad)


Use = Outer | Direct


def _left_gram(a: Outer, b: Outer) -> torch.Tensor:
    """(n, T, S): left_t . left'_s, one-hot factors as comparisons and gathers."""
    if a.index and b.index:
        return (a.left.unsqueeze(2) == b.left.unsqueeze(1)).to(a.right.dtype)
    if a.index:
        return torch.gather(b.left, 2, a.left.unsqueeze(1).expand(-1, b.left.shape[1], -1)).transpose(1, 2)
    if b.index:
        return torch.gather(a.left, 2, b.left.unsqueeze(1).expand(-1, a.left.shape[1], -1))
    return a.left @ b.left.transpose(1, 2)


def _gram(a: Outer, b: Outer) -> torch.Tensor:
    return (_left_gram(a, b) * (a.right @ b.right.transpose(1, 2))).sum((1, 2))


def _materialised(a: Use, b: Use, n: int, shape: tuple[int, int]) -> torch.Tensor:
    per = max(1, CHUNK_FLOATS // max(1, shape[0] * shape[1]))
    parts = []
    for start in range(0, n, per):
        rows = slice(start, min(n, start + per))
        ga = a.dense(rows)
        gb = ga if b is a else b.dense(rows)
        parts.append((ga * gb).sum((1, 2)))
    return torch.cat(parts)


def inner(a: Use, b: Use, n: int, shape: tuple[int, int], form: str = "auto") -> torch.Tensor:
    """<G_i^a, G_i^b> for every example i, (n,). ``form``: ``gram``, ``direct`` (materialise) or
    ``auto`` (the one with fewer operations; a Direct use is always materialised)."""
    if isinstance(a, Outer) and isinstance(b, Outer):
        gram_cost = a.tokens * b.tokens * (shape[0] + shape[1])
        direct_cost = (a.tokens + b.tokens) * shape[0] * shape[1]
        if form == "gram" or (form == "auto" and gram_cost <= direct_cost):
            return _gram(a, b)
    return _materialised(a, b, n, shape)
