"""Attention features of prompt sets, kept in factored form.

A prompt's feature is the rank-one matrix Z = q v^T (equation 2.5) with q the
query token x_{L+1} and v = (1/L) sum_i y_i x_i. Storing (q, v) instead of Z
costs D times less memory, and every operation the estimators need is a pair
of batched matrix products. Shapes: B trials, N prompts, D dimensions, and M
parameter matrices per trial (one per horizon T).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline import lazy

if TYPE_CHECKING:
    from torch import Tensor

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)


@dataclass
class Features:
    """Features are not modified once built (an attack builds new ones), so a slice's view
    and a small gram are computed once and remembered: the estimators of one cell, and
    the cells that reuse the problem, share them."""

    q: Tensor  # (B, N, D) query tokens
    v: Tensor  # (B, N, D) context summaries
    y: Tensor  # (B, N) targets y_{L+1}
    _slices: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _gram: Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def __getitem__(self, trials) -> "Features":
        """The features of a subset of the trials (a slice, index or mask); the same object
        for the same slice (a chunk of trials), so that what it remembers is shared."""
        if not isinstance(trials, slice):
            return Features(self.q[trials], self.v[trials], self.y[trials])
        key = (trials.start, trials.stop, trials.step)
        if key not in self._slices:
            self._slices[key] = Features(self.q[trials], self.v[trials], self.y[trials])
        return self._slices[key]

    def to(self, device) -> "Features":
        """The same features on ``device`` (these very tensors where they are there already)."""
        return Features(self.q.to(device), self.v.to(device), self.y.to(device))

    def reshape(self, *shape: int) -> "Features":
        """The same prompts with leading dimensions ``shape`` (e.g. trials x prompts)."""
        D = self.q.shape[-1]
        return Features(self.q.reshape(*shape, D), self.v.reshape(*shape, D), self.y.reshape(*shape))

    def inner(self, gamma: Tensor) -> Tensor:
        """<Gamma_m, Z_k> = q_k^T Gamma_m v_k for gamma (B, M, D, D): returns (B, M, N)."""
        B, M, D, _ = gamma.shape
        qg = self.q @ gamma.transpose(1, 2).reshape(B, D, M * D)  # (B, N, M*D): one wide product
        return (qg.view(B, -1, M, D) * self.v.unsqueeze(2)).sum(-1).transpose(1, 2)

    def combine(self, r: Tensor) -> Tensor:
        """sum_k r_mk Z_k for weights r (B, M, N): returns (B, M, D, D)."""
        B, M, N = r.shape
        D = self.q.shape[-1]
        qr = (self.q.unsqueeze(2) * r.transpose(1, 2).unsqueeze(-1)).reshape(B, N, M * D)
        return (qr.mT @ self.v).view(B, M, D, D)

    def flat(self) -> Tensor:
        """vec(Z_k) (row-major, so vec(Z) . vec(Gamma) = <Gamma, Z>): (B, N, D^2)."""
        B, N, D = self.shape
        return (self.q.unsqueeze(-1) * self.v.unsqueeze(-2)).reshape(B, N, D * D)

    def shared(self) -> "Features | None":
        """Where every trial holds the same prompts as stride-0 views (the audit's canary: one
        prompt set repeated for every run), that one set as a batch of one; otherwise None. What
        depends on the prompts alone (the Gram, the moment) is then computed once and expanded,
        instead of once per trial on a materialised copy."""
        if self.q.shape[0] > 1 and self.q.stride(0) == self.v.stride(0) == self.y.stride(0) == 0:
            return Features(self.q[:1], self.v[:1], self.y[:1])
        return None

    def gram(self) -> Tensor:
        """(1/N) sum_k vec(Z_k) vec(Z_k)^T: (B, D^2, D^2). Remembered when it is no larger
        than the features it summarises (D^4 <= N (2D + 1)), so memory at most doubles, and
        always when the trials share their prompts (one Gram, expanded: ``shared``)."""
        if self._gram is not None:
            return self._gram
        one = self.shared()
        if one is not None:
            self._gram = one.gram().expand(self.q.shape[0], -1, -1)
            return self._gram
        z = self.flat()
        H = z.mT @ z / z.shape[1]
        B, N, D = self.shape
        if D**4 <= N * (2 * D + 1):
            self._gram = H
        return H

    def kernel(self) -> Tensor:
        """K_jk = <Z_j, Z_k> = (q_j.q_k)(v_j.v_k): (B, N, N)."""
        return (self.q @ self.q.mT) * (self.v @ self.v.mT)

    def moment(self) -> Tensor:
        """(1/N) sum_k y_k Z_k: (B, D, D)."""
        one = self.shared()
        if one is not None:
            return one.moment().expand(self.q.shape[0], -1, -1)
        return self.combine(self.y.unsqueeze(1)).squeeze(1) / self.y.shape[1]

    def norms(self) -> Tensor:
        """||Z_k||_F = ||q_k|| ||v_k||: (B, N)."""
        return self.q.norm(dim=-1) * self.v.norm(dim=-1)


def from_tokens(x: Tensor, y: Tensor, clip: float | None = None) -> Features:
    """Features of prompts whose tokens are the columns of x (..., D, L+1), as in the paper's
    prompt matrix E, with responses y (..., L+1); the last column is the query. With
    ``clip=C`` every response is clipped to [-C, C] first (Algorithm 1's clip_C): the
    context sum and the target both use clipped responses."""
    if clip is not None:
        bound = torch.tensor(clip, dtype=y.dtype)
        if bound.item() > clip:  # rounded up to y's precision: take the next value below, so |y| <= C holds
            bound = torch.nextafter(bound, torch.zeros_like(bound))
        y = y.clamp(-bound.item(), bound.item())
    L = x.shape[-1] - 1
    v = (x[..., :L] @ y[..., :L, None]).squeeze(-1) / L
    # copies, not views: a view would keep every token of the prompts alive
    return Features(x[..., L].clone(), v, y[..., L].clone())


def privatize(clipped: Features, G: float) -> Features:
    """Z~ = Pi_G(Z) for features built from clipped responses: ||Z~_k||_F <= G."""
    return Features(clipped.q, project_rows(clipped.v, clipped.q, G), clipped.y)


def project_rows(v: Tensor, q: Tensor, G: float) -> Tensor:
    """Pi_G on q v^T: rescale v so that ||q v^T||_F = ||q|| ||v|| <= G."""
    norm = q.norm(dim=-1, keepdim=True) * v.norm(dim=-1, keepdim=True)
    return v * torch.clamp(G / norm.clamp_min(torch.finfo(v.dtype).tiny), max=1.0)


def project_frobenius(gamma: Tensor, R: float) -> Tensor:
    """Pi_R: the nearest matrix of Frobenius norm at most R (batched over leading dims)."""
    norm = torch.linalg.matrix_norm(gamma, keepdim=True)
    return gamma * torch.clamp(R / norm.clamp_min(torch.finfo(gamma.dtype).tiny), max=1.0)
