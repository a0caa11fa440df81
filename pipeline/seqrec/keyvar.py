"""The variance of a block's key input along the directions its logits read, through the block before it.

A logit of block b + 1 reads its key token y_s (block b's output) along one direction per query,
a_t = W_k^T q_t: it needs Var(a_t . y_s), not the per-coordinate variances of y_s. The two differ by
the covariance between y_s's coordinates, which the per-coordinate propagation
(``reattention.DPFormer._block``) drops: block b mixes its input's noise through W_v, W_o, the
feed-forward W_2 diag(relu') W_1 and the two LayerNorms, whose Jacobians move the whole token (its
scale) and tie its coordinates (its centring). On a trained model these directions line up with
what the keys read, and dropping them put block 2's logit variances at about a tenth of Monte
Carlo's (issue 41).

``Pullback`` computes Var(a_t . y_s) for every query direction a_t and key token s by the delta
method through block b, pulling a_t back to the noise sources, which are independent: block b's
input tokens (independent coordinates of the propagated variances; exact for the first block, whose
input is the noisy item and position tables) and every weight's noise (std ``err``). With the
LayerNorm Jacobian at the expected scale (``reattention.normalised_moments``),
J(z) = (P z - x (x . z) / d) / s (P the centring, x the normalised mean token, s its scale), and
D = P(pre > 0) the ReLU's expected slope (Stein's lemma: Cov(relu(X), X) = D Var X for Gaussian X),

    b  = J_2(gamma_2 * a)                         LN 2's input r_2 = x_1 + W_2 relu(W_1 x_1 + b_1) + b_2
    c  = b + W_1^T (D * W_2^T b)                  LN 1's output x_1 (residual and feed-forward)
    c1 = J_1(gamma_1 * c)                         LN 1's input r = x + W_o merge(sum_j att_sj V_j) + b_o
    o  = W_o^T c1,  w_h = W_v,h^T o_h             through the attention (its weights att as constants)

    Var(a . y_s) = sum_k a_k^2 (e^2 (Var xhat_2 + xhat_2^2) + e^2)          gamma_2, beta_2
                 + sum_k (W_2^T b)_k^2 (Var relu - D^2 Var pre)_k              ReLU's non-linear part
                 + |D * W_2^T b|^2 e^2 (|x_1|^2 + tr Var x_1 + 1)              W_1, b_1
                 + |b|^2 e^2 (|relu|^2 + tr Var relu + 1)                      W_2, b_2
                 + sum_k c_k^2 (e^2 (Var xhat_1 + xhat_1^2) + e^2)             gamma_1, beta_1
                 + |c1|^2 e^2 (|y|^2 + tr Var y + 1)                           W_o, b_o
                 + sum_h |o_h|^2 sum_j att_h,sj^2 e^2 (|x_j|^2 + tr Var x_j + 1)   W_v, b_v
                 + sum_j sum_k (1[j = s] c1 + sum_h att_h,sj w_h)_k^2 Var x_j,k     the block's input

(means and traces at the propagated moments). Kept from the per-coordinate propagation: the
tokens' input noise independent (an item repeated in a sequence shares its row's noise), a
weight's noise independent between tokens, dropout ignored. For the first block's output (the
second block's keys) the input term is exact; for later blocks the input's own covariance is
dropped. Cost: T^2 d d_ff per user and head (one (T, T, d_ff) contraction), or for long sequences
T d^2 d_ff + T^2 d^2 (M_s = W_2 diag(D_s) W_1 formed per key token), whichever is fewer, in chunks
of users.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 2**24  # elements of the widest (users, heads, T, T, .) tensor formed at once


def _dot(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Per-(t, s) inner products of u (n, H, T, k) and v (n, T, k): (n, H, T, T)."""
    return u @ v[:, None].transpose(-1, -2)


@dataclass
class Pullback:
    """What one block's noise propagation leaves for the next block's key variances (the block
    ``block``; tensors batch first, (n, T, .) per token, att (n, h, T, T))."""
    block: torch.nn.Module
    err: float
    mean_in: torch.Tensor   # the block's input: mean (n, T, d)
    var_in: torch.Tensor    # and per-coordinate variances (n, T, d)
    att: torch.Tensor       # the attention weights the block used (n, h, T, T)
    mean_y: torch.Tensor    # the attention's merged output before W_o (n, T, d)
    var_y: torch.Tensor
    x1: torch.Tensor        # LN 1: normalised mean token at the expected scale (n, T, d)
    s1: torch.Tensor        # its scale s^2 (n, T, 1)
    var_xhat1: torch.Tensor
    mean_1: torch.Tensor    # LN 1's output (n, T, d) and its variances
    var_1: torch.Tensor
    slope: torch.Tensor     # D = P(pre > 0) (n, T, d_ff)
    extra: torch.Tensor     # Var relu - D^2 Var pre (n, T, d_ff)
    mean_act: torch.Tensor  # relu's output (n, T, d_ff) and its variances
    var_act: torch.Tensor
    x2: torch.Tensor        # LN 2: as LN 1
    s2: torch.Tensor
    var_xhat2: torch.Tensor
    diag: torch.Tensor      # the block output's per-coordinate variances (what the propagation carries)

    def quadratic(self, a: torch.Tensor, path: str = "auto") -> torch.Tensor:
        """Var(a_t . y_s) for directions a (n, H, T, d), one per query t, and every key token s of the
        block's output y: (n, H, T, T). ``path``: the feed-forward's pull-back per (t, s) pair
        (``pairs``: T^2 d d_ff per user and head) or through M_s = W_2 diag(D_s) W_1 formed per key token
        (``tokens``: T d^2 d_ff + T^2 d^2, fewer for sequences longer than about d); ``auto``: the cheaper."""
        n = a.shape[0]
        heads = self.att.shape[1]  # the (users, H, T, T, .) tensors: d_ff wide, and (heads x d) wide
        per = max(1, CHUNK // max(1, a.shape[1] * a.shape[2] * self.var_in.shape[1]
                                  * max(self.slope.shape[-1], heads * a.shape[-1])))
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("block", "err")}
        parts = []
        for start in range(0, n, per):
            rows = slice(start, min(n, start + per))
            parts.append(_quadratic(self.block, self.err, a[rows], path=path,
                                    **{k: v[rows] for k, v in fields.items()}))
        return torch.cat(parts) if parts else a.new_zeros(a.shape[:3] + (a.shape[2],))


def _quadratic(block, err: float, a, *, path: str = "auto", mean_in, var_in, att, mean_y, var_y, x1, s1, var_xhat1, mean_1, var_1,
               slope, extra, mean_act, var_act, x2, s2, var_xhat2, diag) -> torch.Tensor:
    e2 = err * err
    d = a.shape[-1]
    attn = block.attn
    w1, w2 = block.ff1.weight, block.ff2.weight  # (d_ff, d), (d, d_ff)
    # LN 2: b_ts = (P g_t - x2_s (x2_s . g_t) / d) / s2_s, g = gamma_2 a
    g = a * block.ln2.weight
    pg = g - g.mean(-1, keepdim=True)  # (n, H, T, d)
    kappa = _dot(g, x2)  # (n, H, T, T): x2_s . g_t
    inv = s2[..., 0].rsqrt()[:, None, None, :]  # 1 / s_s, (n, 1, 1, T)
    b = (pg[..., :, None, :] - x2[:, None, None] * (kappa / d)[..., None]) * inv[..., None]  # (n, H, T, T, d)
    # W_2^T b = (A_t - B_s kappa_ts / d) / s_s with A_t = W_2^T P g_t, B_s = W_2^T x2_s
    A, B = pg @ w2, x2 @ w2  # (n, H, T, d_ff), (n, T, d_ff)
    k_ = (kappa / d) * inv

    def weighted(weights: torch.Tensor) -> torch.Tensor:
        """sum_k (W_2^T b)_k^2 weights_s,k, for weights (n, T, d_ff): (n, H, T, T)."""
        return (_dot(A * A, weights) * inv * inv - 2 * _dot(A, B * weights) * inv * k_
                + k_ * k_ * (B * B * weights).sum(-1)[:, None, None, :])

    out = (a * a) @ (e2 * (var_xhat2 + x2 * x2) + e2)[:, None].transpose(-1, -2)  # gamma_2, beta_2
    out = out + weighted(extra)
    out = out + weighted(slope * slope) * (e2 * ((mean_1 * mean_1).sum(-1) + var_1.sum(-1)) + e2)[:, None, None, :]
    out = out + (b * b).sum(-1) * (e2 * ((mean_act * mean_act).sum(-1) + var_act.sum(-1)) + e2)[:, None, None, :]
    # c_ts = b_ts + W_1^T (D_s * W_2^T b_ts) = b_ts + (W_1^T (D_s * A_t) - W_1^T (D_s * B_s) kappa_ts / d) / s_s
    H, Tq, T, d_ff = a.shape[1], a.shape[2], b.shape[3], w1.shape[0]
    if path == "pairs" or (path == "auto" and H * Tq * T * d_ff * d <= T * d * d_ff * d + H * Tq * T * d * d):
        DA = (A[..., :, None, :] * slope[:, None, None]) @ w1  # (n, H, T, T, d): the T^2 d d_ff contraction
        DB = (slope * B) @ w1  # (n, T, d)
        c = b + (DA - DB[:, None, None] * (kappa / d)[..., None]) * inv[..., None]
    else:  # long sequences: M_s = W_2 diag(D_s) W_1 per key token (T d^2 d_ff), then c = b + b M_s (T^2 d^2)
        m = (w2[None, None] * slope[:, :, None, :]) @ w1  # (n, T, d, d)
        c = b + torch.einsum("nHtsd,nsde->nHtse", b, m)
    out = out + (c * c * (e2 * (var_xhat1 + x1 * x1) + e2)[:, None, None]).sum(-1)  # gamma_1, beta_1
    # LN 1: c1 = J_1(gamma_1 c)
    g1 = c * block.ln1.weight
    pg1 = g1 - g1.mean(-1, keepdim=True)
    c1 = (pg1 - x1[:, None, None] * ((g1 * x1[:, None, None]).sum(-1, keepdim=True) / d)) * s1[:, None, None].rsqrt()
    out = out + (c1 * c1).sum(-1) * (e2 * ((mean_y * mean_y).sum(-1) + var_y.sum(-1)) + e2)[:, None, None, :]
    # through W_o and the attention: o = W_o^T c1, per head h of this block w_h = W_v,h^T o_h
    h = attn.heads
    dh = d // h
    o = (c1 @ attn.out.weight).unflatten(-1, (h, dh))  # (n, H, T, T, h, dh)
    w = torch.einsum("nHtshk,hkd->nHtshd", o, attn.v.weight.view(h, dh, d))
    zeta = e2 * ((mean_in * mean_in).sum(-1) + var_in.sum(-1)) + e2  # (n, T): W_v, b_v at each input token
    out = out + torch.einsum("nHtsh,nhs->nHts", (o * o).sum(-1), torch.einsum("nhsj,nj->nhs", att * att, zeta))
    # the block's input: sum_j sum_k (1[j = s] c1 + sum_h att_h,sj w_h)_k^2 Var x_j,k
    out = out + (c1 * c1 * var_in[:, None, None]).sum(-1)
    out = out + 2 * torch.einsum("nHtsd,nHtshd,nhs,nsd->nHts", c1, w, att.diagonal(dim1=-2, dim2=-1), var_in)
    vbar = torch.einsum("nasj,nbsj,njd->nabsd", att, att, var_in)  # (n, h, h, T, d)
    return out + torch.einsum("nHtsad,nHtsbd,nabsd->nHts", w, w, vbar)
