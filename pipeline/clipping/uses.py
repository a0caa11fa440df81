"""One use of a parameter by one layer call, as the per-example gradient it contributes, and the
inner products between uses that make up a tied parameter's per-example squared norm.

A parameter W of shape (P, Q) (a vector: (1, Q)) used by a layer gets, from one call on a batch
of n examples, the per-example gradient G_i = sum_t left_it right_it^T (``Outer``): a linear layer
y = x W^T has left = dL/dy (P = outputs) and right = x (Q = inputs); an embedding lookup y = W[id]
has left = one-hot(id) (``index=True``) and right = dL/dy; a dense left factor may cover a block of
W's rows (``offset``). A parameter whose per-example gradient is no outer product (a LayerNorm's
weight, a bias) gives it whole (``Direct``: (n, P, Q), or per token, (n, T, Q), summed over T).

The per-example squared norm of a parameter used k times is ||sum_u G_i^u||^2 = sum_{u, v}
<G_i^u, G_i^v>: every use with itself and every cross term between two uses (the tied embedding's
input and output uses: Phantom Clipping). Each inner product is exact, in one of two forms with
the fewer operations: the Gram form sum_{t,s} (left_t . left'_s)(right_t . right'_s) costs about
T S (P + Q) per example, materialising both gradients about (T + S) P Q, weighted by ``MATERIALISING``
(it also writes and reads the n P Q floats it forms, which the count of multiply-adds omits).

A use's ``weighted_sum(c)`` returns a new tensor (the engine adds a tied parameter's other uses' sums
into it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_FLOATS = 2**24  # materialised per-example gradients are formed this many floats at a time
# Materialising's cost per counted multiply-add, relative to the Gram form's: ``benchmarks/clipping_forms.py``
# times both forms at the project's 36 layer shapes (docs/clipping_forms.json, one CPU thread). Counted alike
# (weight 1), the rule took the slower form in 5 of them, among them the tied output layer (2.3-2.5x slower:
# materialising writes and reads each example's V x d gradient). The Gram form wins up to a count 1.33x
# materialising's, materialising from 1.56x: 1.4 lies between.
MATERIALISING = 1.4


@dataclass
class Outer:
    """G_i = sum_t left[i, t] right[i, t]^T; ``left`` is (n, T, W) or, for ``index=True``, (n, T)
    row indices into P rows (a one-hot left factor); ``right`` is (n, T, Q). A dense ``left`` covers
    the parameter's rows ``offset`` to ``offset + W - 1`` (all P of them by default): a layer that
    uses a block of its parameter's rows, such as scores against a table's rows 1..M past a padding
    row 0."""
    left: torch.Tensor
    right: torch.Tensor
    rows: int  # P
    index: bool = False
    offset: int = 0

    @property
    def tokens(self) -> int:
        return self.right.shape[1]

    @property
    def span(self) -> tuple[int, int]:
        """The parameter rows a dense left factor covers, [start, stop)."""
        return (0, self.rows) if self.index else (self.offset, self.offset + self.left.shape[-1])

    def _place(self, block: torch.Tensor) -> torch.Tensor:
        """A (..., W, Q) block of rows into the parameter's (..., P, Q)."""
        start, stop = self.span
        if (start, stop) == (0, self.rows):
            return block
        out = block.new_zeros(*block.shape[:-2], self.rows, block.shape[-1])
        out[..., start:stop, :] = block
        return out

    def dense(self, rows: slice, placed: bool = True) -> torch.Tensor:
        """The per-example gradients of examples ``rows``, (m, P, Q) (``placed=False``: a dense left
        factor's own rows only, (m, W, Q))."""
        right = self.right[rows]
        if not self.index:
            block = self.left[rows].transpose(1, 2) @ right
            return self._place(block) if placed else block
        m, _, q = right.shape
        out = right.new_zeros(m, self.rows, q)
        return out.scatter_add_(1, self.left[rows].unsqueeze(-1).expand(-1, -1, q), right)

    def weighted_sum(self, c: torch.Tensor) -> torch.Tensor:
        """sum_i c_i G_i, (P, Q): the clipped sum by book-keeping (no second backward pass), the
        narrower factor weighted (a language model's (n, T, V) logits' gradient is not copied)."""
        c = c.to(self.right.dtype)
        if self.index:
            right = (c.view(-1, 1, 1) * self.right).reshape(-1, self.right.shape[-1])
            return right.new_zeros(self.rows, right.shape[-1]).index_add_(0, self.left.reshape(-1), right)
        left, right = self.left.to(self.right.dtype), self.right
        if right.shape[-1] <= left.shape[-1]:
            right = c.view(-1, 1, 1) * right
        else:
            left = c.view(-1, 1, 1) * left
        return self._place(left.reshape(-1, left.shape[-1]).transpose(0, 1) @ right.reshape(-1, right.shape[-1]))

    def add_weighted_sum(self, c: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` += sum_i c_i G_i, in place, for a lookup (``index=True``): its rows added where they fall,
        no (P, Q) tensor of its own (a tied table's other use made ``out``)."""
        right = (c.to(self.right.dtype).view(-1, 1, 1) * self.right).reshape(-1, self.right.shape[-1])
        return out.index_add_(0, self.left.reshape(-1), right.to(out.dtype))


@dataclass
class Direct:
    """G_i given whole, (n, P, Q); or, for a vector parameter, as ``tokens`` (n, T, Q) whose sum
    over T is G_i (a bias, a LayerNorm weight: kept per token so that the calls of a layer used
    several times join by concatenation, and are summed once)."""
    grad: torch.Tensor | None = None
    tokens: torch.Tensor | None = None

    def whole(self, rows: slice = slice(None)) -> torch.Tensor:
        return self.grad[rows] if self.tokens is None else self.tokens[rows].sum(1).unsqueeze(1)

    def dense(self, rows: slice, placed: bool = True) -> torch.Tensor:
        return self.whole(rows)

    def weighted_sum(self, c: torch.Tensor) -> torch.Tensor:
        grad = self.whole()
        n, p, q = grad.shape
        return (c.to(grad.dtype) @ grad.reshape(n, p * q)).reshape(p, q)


Use = Outer | Direct


def _gathered(ids: torch.Tensor, dense: Outer) -> torch.Tensor:
    """(n, T_dense, S_ids): dense.left at the rows ``ids`` name (zero where they fall outside its span)."""
    start, stop = dense.span
    idx = ids - start
    got = torch.gather(dense.left, 2, idx.clamp(0, stop - start - 1).unsqueeze(1).expand(-1, dense.left.shape[1], -1))
    if (start, stop) == (0, dense.rows):
        return got  # every id is a row the dense factor covers (no test of the ids: a host synchronisation)
    inside = (idx >= 0) & (idx < stop - start)
    return got * inside.unsqueeze(1).to(got.dtype)


def _left_gram(a: Outer, b: Outer) -> torch.Tensor:
    """(n, T, S): left_t . left'_s, one-hot factors as comparisons and gathers, dense ones over the
    rows both cover."""
    if a.index and b.index:
        return (a.left.unsqueeze(2) == b.left.unsqueeze(1)).to(a.right.dtype)
    if a.index:
        return _gathered(a.left, b).transpose(1, 2)
    if b.index:
        return _gathered(b.left, a)
    if a.span == b.span:
        return a.left @ b.left.transpose(1, 2)
    start, stop = max(a.span[0], b.span[0]), min(a.span[1], b.span[1])
    if start >= stop:
        return a.left.new_zeros(a.left.shape[0], a.left.shape[1], b.left.shape[1])
    la = a.left[..., start - a.span[0]:stop - a.span[0]]
    lb = b.left[..., start - b.span[0]:stop - b.span[0]]
    return la @ lb.transpose(1, 2)


def _gram(a: Outer, b: Outer) -> torch.Tensor:
    return (_left_gram(a, b) * (a.right @ b.right.transpose(1, 2))).sum((1, 2))


def _materialised(a: Use, b: Use, n: int, shape: tuple[int, int]) -> torch.Tensor:
    # a dense use with itself (or with one on the same rows): its own rows only, no zero rows formed
    own = (isinstance(a, Outer) and isinstance(b, Outer) and not a.index and not b.index and a.span == b.span)
    width = a.left.shape[-1] if own else shape[0]
    per = max(1, CHUNK_FLOATS // max(1, width * shape[1]))
    parts = []
    for start in range(0, n, per):
        rows = slice(start, min(n, start + per))
        ga = a.dense(rows, placed=False) if own else a.dense(rows)
        gb = ga if b is a else (b.dense(rows, placed=False) if own else b.dense(rows))
        if isinstance(ga, torch.Tensor) and ga.shape[1] == 1:  # a vector's (m, 1, Q): summed as (m, Q)
            parts.append((ga * gb).reshape(ga.shape[0], -1).sum(1))
        else:
            parts.append((ga * gb).sum((1, 2)))
    return torch.cat(parts)


def _form(a: Outer, b: Outer, shape: tuple[int, int], form: str) -> str:
    """``gram`` or ``direct`` for <G^a, G^b>: as asked, or (``auto``) the one with fewer operations
    (materialising's weighted by ``MATERIALISING``)."""
    gram_cost = a.tokens * b.tokens * (shape[1] if (a.index or b.index) else shape[0] + shape[1])
    direct_cost = (a.tokens + (0 if b is a else b.tokens)) * shape[0] * shape[1] * MATERIALISING
    return form if form != "auto" else ("gram" if gram_cost <= direct_cost else "direct")


def inner(a: Use, b: Use, n: int, shape: tuple[int, int], form: str = "auto") -> torch.Tensor:
    """<G_i^a, G_i^b> for every example i, (n,). ``form``: ``gram``, ``direct`` (materialise) or
    ``auto`` (the one with fewer operations; a Direct use is always materialised). The Gram form costs
    T S (P + Q) per example for two dense left factors, T S Q where one is one-hot (a comparison or a
    gather, not a P-long product); materialising costs T P Q per use formed (a use with itself is
    formed once). A use of another kind computes its own products (``inner(other, n, shape)``: the chunked
    output layer's, ``pipeline/clipping/chunked.py``, whose left factor is never formed whole)."""
    for one, other in ((a, b), (b, a)):
        product = getattr(one, "inner", None)
        if product is not None:
            return product(other, n, shape)
    if isinstance(a, Outer) and isinstance(b, Outer):
        if a.index and not b.index:  # the dense one first: the (T, S) products in its tokens' order
            a, b = b, a
        if _form(a, b, shape, form) == "gram":
            return _gram(a, b)
    return _materialised(a, b, n, shape)


def stack_key(use: Use, shape: tuple[int, int], form: str) -> tuple | None:
    """Uses of different parameters that one batched computation can serve (the same layer shape in
    every block: each block's query projection, each LayerNorm's weight): a dense left factor covering
    all its parameter's rows, or a per-token vector, keyed by kind, form, shapes, dtypes and device.
    None for the rest (lookups, blocks of rows, whole per-example gradients), served one by one."""
    if isinstance(use, Outer) and not use.index and use.span == (0, use.rows):
        return ("outer", _form(use, use, shape, form), tuple(use.left.shape), tuple(use.right.shape),
                use.left.dtype, use.right.dtype, use.left.device)
    if isinstance(use, Direct) and use.tokens is not None:
        return ("tokens", tuple(use.tokens.shape), use.tokens.dtype, use.tokens.device)
    return None


@dataclass
class Stack:
    """k uses of one ``stack_key``, their factors stacked once along a new first dimension: the
    squared norms of all k per-example gradients and their k clipped sums, each in a few batched
    operations instead of a few per layer (on a GPU each operation is a kernel launch)."""
    uses: list
    kind: str
    form: str = "gram"
    left: torch.Tensor | None = None  # (k, n, T, W)
    right: torch.Tensor | None = None  # (k, n, T, Q)
    per: torch.Tensor | None = None  # "tokens": each example's gradient, (k, n, Q)

    @classmethod
    def of(cls, uses: list, key: tuple) -> "Stack":
        if key[0] == "outer":
            return cls(uses, "outer", key[1], torch.stack([u.left for u in uses]), torch.stack([u.right for u in uses]))
        return cls(uses, "tokens", per=torch.stack([u.tokens for u in uses]).sum(2))

    def sq_norms(self) -> torch.Tensor:
        """(k, n): each use's per-example squared gradient norm."""
        if self.kind == "tokens":
            return self.per.pow(2).sum(-1)
        if self.form == "gram":
            return ((self.left @ self.left.transpose(-1, -2)) * (self.right @ self.right.transpose(-1, -2))).sum((-1, -2))
        k, n = self.left.shape[:2]
        if k * n * self.left.shape[-1] * self.right.shape[-1] > CHUNK_FLOATS:  # materialised a use at a time
            return torch.stack([inner(u, u, n, (u.rows, self.right.shape[-1]), "direct") for u in self.uses])
        return (self.left.transpose(-1, -2) @ self.right).pow(2).sum((-1, -2))

    def weighted_sums(self, c: torch.Tensor) -> torch.Tensor:
        """(k, P, Q): each use's sum_i c_i G_i, the narrower factor weighted."""
        if self.kind == "tokens":
            return torch.einsum("n,knq->kq", c.to(self.per.dtype), self.per).unsqueeze(1)
        left, right = self.left.to(self.right.dtype), self.right
        k, n, T = right.shape[:3]
        scale = c.to(right.dtype).view(1, -1, 1, 1)
        if right.shape[-1] <= left.shape[-1]:
            right = scale * right
        else:
            left = scale * left
        return left.reshape(k, n * T, -1).transpose(1, 2) @ right.reshape(k, n * T, -1)


def merged(found: list[Use]) -> list[Use]:
    """A parameter's uses with those of one kind joined (the calls of a layer used at every step of a
    recurrence, or reused across blocks): Outer uses with the same left factor's kind and rows
    concatenated along the tokens (G_i is a sum over tokens), Direct uses summed. Fewer, longer uses:
    k calls cost one inner product instead of k (k + 1) / 2."""
    out: list[Use] = []
    for use in found:
        for i, have in enumerate(out):
            if isinstance(use, Direct) and isinstance(have, Direct):
                if use.tokens is not None and have.tokens is not None and use.tokens.shape[2:] == have.tokens.shape[2:]:
                    out[i] = Direct(tokens=torch.cat([have.tokens, use.tokens], 1))
                else:
                    out[i] = Direct(have.whole() + use.whole())
                break
            if (isinstance(use, Outer) and isinstance(have, Outer) and use.index == have.index
                    and use.span == have.span and use.rows == have.rows):
                out[i] = Outer(left=torch.cat([have.left, use.left], 1), right=torch.cat([have.right, use.right], 1),
                               rows=have.rows, index=have.index, offset=have.offset)
                break
        else:
            out.append(use)
    return out
