"""DP-SGD (Section 6.4) on the same objective as NoisyHead, batched over trials.

Each step draws a Poisson batch (every prompt independently with probability
q = batch_size / N), clips each prompt's gradient (<Gamma, Z~_k> - y~_k) Z~_k to norm
``max_grad_norm``, adds N(0, (noise_multiplier max_grad_norm)^2 I) to their sum, divides by
the expected batch size q N, adds the penalty's gradient 2 lam Gamma and steps with eta0:
Opacus's DPOptimizer step for a linear model with loss (1/2)(<Gamma, Z> - y)^2, mean
reduction and weight decay 2 lam (``tests/test_dpsgd.py`` checks the two agree on the same
batches and noise). The model is linear, so per-sample gradients are closed-form.

"The same T, eta0 and clipping constants" as NoisyHead: T optimizer steps (T Poisson
batches, not T epochs), the same step size eta0 and penalty, the same private view of the
data (responses clipped at C, features projected at G), and per-sample gradients clipped
at G (C + R G), the bound NoisyHead's sensitivity rests on (it clips nothing while
||Gamma|| <= R; DP-SGD does not project Gamma). The start is NoisyHead's Gamma^0.

Privacy: the noise multiplier is what Opacus's accountant (``accountant``: rdp or prv)
gives for (eps, delta) after T steps of the subsampled Gaussian mechanism at rate q
(``privacy.dpsgd_noise_multiplier``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipeline import lazy, privacy, rng
from pipeline.noisyhead.features import Features
from pipeline.noisyhead.methods.base import Fit, chunks, noise_scale, steps as progress
from pipeline.noisyhead.methods.descent import initial_gamma

if TYPE_CHECKING:
    from torch import Tensor

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)

PRIVATE = True
ITERATIVE = True  # runs T steps: its time per step is logged
OPACUS_EPS = 1e-6  # Opacus's clip factor is max_grad_norm / (norm + 1e-6)


def descend(feats: Features, gamma0: Tensor, *, lam: float, eta0: float, steps: int, sample_rate: float,
            max_grad_norm: float, sigma: float, masks: Tensor, noise: Tensor) -> Tensor:
    """T DP-SGD steps from gamma0 (B, D, D), given the Poisson batches ``masks`` (B, T, N) and the
    standard normals ``noise`` (B, T, D, D): returns Gamma^T (B, D, D)."""
    gamma = gamma0.unsqueeze(1)
    norms = feats.norms().unsqueeze(1)  # ||Z_k||: (B, 1, N)
    expected = sample_rate * feats.y.shape[-1]
    for t in progress(steps, "dpsgd steps"):
        r = feats.inner(gamma) - feats.y.unsqueeze(1)  # per-sample gradient is r_k Z_k
        clip = (max_grad_norm / (r.abs() * norms + OPACUS_EPS)).clamp(max=1.0)
        summed = feats.combine(masks[:, t].unsqueeze(1) * clip * r)
        grad = (summed + sigma * max_grad_norm * noise[:, t].unsqueeze(1)) / expected + 2 * lam * gamma
        gamma = gamma - eta0 * grad
    return gamma.squeeze(1)


def check(spec, cfg, const) -> str | None:
    if spec.accountant not in ("rdp", "prv"):
        return f"accountant must be 'rdp' or 'prv', got {spec.accountant!r}"
    size = spec.batch_size
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < math.inf:
        return f"batch_size (the expected Poisson batch) must be a positive number, got {size!r}"
    if spec.batch_size > cfg.regime.N:
        return f"batch_size {spec.batch_size} exceeds regime.N = {cfg.regime.N}"
    return None


def fit(problem, const, cfg, spec, stream: str = "") -> Fit:
    B, N, D = problem.private.shape
    dtype, device = problem.private.q.dtype, problem.private.q.device
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    q = min(1.0, spec.batch_size / N)
    clip = const.G * (const.C + const.R * const.G)
    scale = noise_scale(spec)
    sigmas = [scale * privacy.dpsgd_noise_multiplier(eps=eps, delta=delta, sample_rate=q, steps=T,
                                                     accountant=spec.accountant)
              for T in const.T]
    parts = []
    for i, sl in chunks(B, cfg.compute.chunk_trials, "dpsgd"):
        gamma0 = initial_gamma(seed=cfg.seed, stream="init" + stream, trials=sl, D=D, scale=const.init_scale,
                               R=const.R, dtype=dtype, device=device)
        out = []
        for T, sigma in zip(const.T, sigmas):
            gens = rng.generators(cfg.seed, f"dpsgd:T={T}{stream}", sl)  # per trial: its batches, then its noise
            masks = (rng.uniform(gens, (T, N), device) < q).to(dtype)
            noise = rng.normal(gens, (T, D, D), dtype, device)
            out.append(descend(problem.private[sl], gamma0, lam=const.lam, eta0=const.eta0, steps=T,
                               sample_rate=q, max_grad_norm=clip, sigma=sigma, masks=masks, noise=noise))
        parts.append(torch.stack(out, 1))
    spent = [privacy.dpsgd_spent_epsilon(sigma=s, delta=delta, sample_rate=q, steps=T, accountant=spec.accountant)
             for T, s in zip(const.T, sigmas)]
    params = {
        "accountant": spec.accountant, "batch_size": spec.batch_size, "sample_rate": q, "max_grad_norm": clip,
        "noise_multiplier": ",".join(f"{s:.6g}" for s in sigmas),
        "noise_std": ",".join(f"{s * clip / (q * N):.6g}" for s in sigmas),  # per step, on the averaged gradient
        "spent_eps": ",".join(f"{e:.6g}" for e in spent),
    }
    return Fit(gamma=torch.cat(parts), private=True, params=params)
