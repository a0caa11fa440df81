"""Every horizon of the update at the price of a few products by H, and the proof that this is exact.

While no projection acts, the update Gamma <- A Gamma + eta b + s xi_t, with
A = c I - eta H and c = 1 - 2 lam eta, is linear. Expanding A^m = sum_k alpha_k(m) (-eta H)^k,
alpha_k(m) = binom(m, k) c^(m-k), gives

    Gamma^T = sum_k (-eta H)^k w_k(T),
    w_k(T) = alpha_k(T) Gamma^0 + eta b sum_{m<T} alpha_k(m) + s sum_{t<T} alpha_k(T-1-t) xi_t,

evaluated by Horner's rule with K products by H instead of T. With h = eta ||H||_2 the
terms beyond K weigh at most sum_{k>K} (T h)^k / k!, and K is chosen to push that
below float64 round-off.

Whether a projection acts is decided without running the trajectory: the same
recursion without H, Gamma^c_{t+1} = c Gamma^c_t + eta b + s xi_t, costs O(D^2) a
step, and e_t = Gamma_t - Gamma^c_t obeys e_{t+1} = A e_t - eta H Gamma^c_t, so
||e_{t+1}|| <= c ||e_t|| + h ||Gamma^c_t|| (||A||_2 <= c as 0 <= eta H <= 2c). A
horizon whose bound ||Gamma^c_t|| + E_t stays below R at every step never meets Pi_R,
and its closed form is exactly Algorithm 1's output.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipeline import lazy

if TYPE_CHECKING:
    from torch import Tensor

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)

TOLERANCE = 1e-18  # relative weight of the dropped series terms


def terms(x: float) -> int | None:
    """Smallest K with sum_{k>K} x^k / k! <= TOLERANCE, for x = T eta ||H||; None if x > 1
    (the series would need many terms and cancel; the step-by-step run is then as cheap)."""
    if x > 1:
        return None
    K, term = 0, 1.0  # term = x^K / K!
    while term * x / (K + 1) / (1 - x / (K + 2)) > TOLERANCE:
        K += 1
        term *= x / K
    return K


def _alpha(K: int, m_max: int, c: float, dtype, device=None) -> Tensor:
    """alpha[k, m] = binom(m, k) c^(m - k) for k <= K, m <= m_max (0 where k > m), on ``device``."""
    m = torch.arange(m_max + 1, dtype=torch.float64, device=device)
    k = torch.arange(K + 1, dtype=torch.float64, device=device).unsqueeze(1)
    log_binom = torch.lgamma(m + 1) - torch.lgamma(k + 1) - torch.lgamma((m - k).clamp_min(0) + 1)
    alpha = torch.exp(log_binom + (m - k) * math.log(c))
    return torch.where(k <= m, alpha, torch.zeros_like(alpha)).to(dtype)


def evaluate(quad, gamma0: Tensor, *, lam, eta0, T, terms: int, radius=math.inf, noise_std=None, noise=None) -> Tensor:
    """Gamma^T for every T of the unprojected update, (B, len(T), D, D)."""
    c = 1 - 2 * lam * eta0
    B, D, _ = gamma0.shape
    K, J, t_max = terms, len(T), max(T)
    alpha = _alpha(K, t_max, c, gamma0.dtype, gamma0.device)  # (K+1, t_max+1)
    Ts = torch.tensor(T, device=gamma0.device)
    start = alpha[:, Ts]  # (K+1, J): coefficient of Gamma^0
    drift = eta0 * torch.cumsum(alpha, 1)[:, Ts - 1]  # (K+1, J): of b, summed over m < T
    # The deterministic part needs only the Krylov vectors (-eta H)^k Gamma^0 and (-eta H)^k b.
    krylov = [torch.stack([gamma0, quad.b], 1)]  # (B, 2, D, D)
    for _ in range(K):
        krylov.append(-eta0 * quad.apply(krylov[-1]))
    krylov = torch.stack(krylov, 1)  # (B, K+1, 2, D, D)
    gamma = torch.einsum("kj,bkxy->bjxy", start, krylov[:, :, 0]) + torch.einsum("kj,bkxy->bjxy", drift, krylov[:, :, 1])
    if noise_std is None:
        return gamma
    # The noise part: w_k = s sum_{t<T} alpha_k(T-1-t) xi_t differs for every horizon; Horner's rule.
    t = torch.arange(t_max, device=gamma0.device)
    lag = Ts.view(J, 1) - 1 - t  # T - 1 - t, negative where t >= T
    weights = alpha[:, lag.clamp_min(0)] * (lag >= 0)  # (K+1, J, t_max)
    weights = weights * gamma0.new_tensor(noise_std).view(1, J, 1)
    w = (weights.reshape((K + 1) * J, t_max) @ noise.reshape(B, t_max, D * D)).reshape(B, K + 1, J, D, D)
    acc = w[:, K]
    for k in reversed(range(K)):
        acc = w[:, k] - eta0 * quad.apply(acc)
    return gamma + acc


def certified(quad, gamma0: Tensor, *, lam, eta0, T, radius=math.inf, noise_std=None, noise=None) -> Tensor:
    """Per trial, whether no horizon's iterate can leave the ball of radius R: (B,) bool."""
    B = gamma0.shape[0]
    if not math.isfinite(radius):
        return torch.ones(B, dtype=torch.bool, device=gamma0.device)
    c = 1 - 2 * lam * eta0
    h = eta0 * quad.norm_bound()  # (B,) >= eta ||H||_2
    if (h > 2 * c).any():
        return torch.zeros(B, dtype=torch.bool, device=gamma0.device)
    t_max = max(T)
    g0, b = gamma0.flatten(1), quad.b.flatten(1)
    stds = gamma0.new_tensor(noise_std if noise_std is not None else [0.0] * len(T))  # (J,)
    # Gamma^c_t = p_t + s n_t: p_t = c^t Gamma^0 + eta b (1 - c^t)/(1 - c), n_{t+1} = c n_t + xi_t
    gn, bn, nn = [], [], []
    n = torch.zeros_like(g0)
    for t in range(t_max):
        if noise_std is not None:
            n = c * n + noise[:, t].flatten(1)
        gn.append((g0 * n).sum(-1))
        bn.append((b * n).sum(-1))
        nn.append(n.square().sum(-1))
    gn, bn, nn = (torch.stack(x, 1) for x in (gn, bn, nn))  # (B, t_max): at t = 1..t_max
    ct = c ** torch.arange(1, t_max + 1, dtype=g0.dtype, device=g0.device)
    geo = eta0 * (1 - ct) / (1 - c)
    gg, gb, bb = g0.square().sum(-1, keepdim=True), (g0 * b).sum(-1, keepdim=True), b.square().sum(-1, keepdim=True)
    pp = ct**2 * gg + 2 * ct * geo * gb + geo**2 * bb
    pn = ct * gn + geo * bn
    norm_c = (pp.unsqueeze(-1) + 2 * stds * pn.unsqueeze(-1) + stds**2 * nn.unsqueeze(-1)).clamp_min(0).sqrt()
    norm_c = torch.cat([g0.norm(dim=-1).view(B, 1, 1).expand(B, 1, len(T)), norm_c], 1)  # t = 0..t_max
    bound = torch.empty_like(norm_c)
    E = torch.zeros_like(norm_c[:, 0])
    for t in range(t_max + 1):
        bound[:, t] = norm_c[:, t] + E
        E = c * E + h.unsqueeze(-1) * norm_c[:, t]
    steps = torch.arange(t_max + 1, device=g0.device).view(1, -1, 1)
    within = (bound <= radius * (1 - 1e-9)) | (steps > torch.tensor(T, device=g0.device).view(1, 1, -1))
    return within.all(1).all(1)
