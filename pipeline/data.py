"""The data step: prompt sets for every Monte Carlo trial, as attention features.

Synthetic prompts follow Section 2: tokens x uniform on the sphere S^{D-1}, a fresh
task w ~ N(0, I_D) per prompt, responses y = w.x + e with e ~ N(0, tau^2). Each
trial gets N training prompts and ``dataset.n_test`` test prompts. The private
view of the training prompts (clipped responses, projected features) is built
here too, since it needs the raw tokens, which are never kept.

Cells of a sweep that share their data (the same N, L, D, seed, ... but another
eps) reuse the last problem built in this process instead of drawing it again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from pipeline import rng
from pipeline.config import Constants
from pipeline.features import Features, from_tokens, privatize

log = logging.getLogger(__name__)


@dataclass
class Problem:
    """One cell's data, batched over B trials."""

    train: Features  # raw features Z_k and responses y_{k,L+1}: ridge oracle, non-private GD
    private: Features  # Z~_k = Pi_G(q clip_C-v^T) and clip_C(y_{k,L+1}): NoisyHead
    test: Features  # fresh, unclipped test prompts
    clip_fraction: float  # share of training responses y_{k,i} that clip_C changed
    projected_fraction: float  # share of training features that Pi_G shrank
    fingerprint: str  # sha256 (prefix) of the raw train and test tensors
    fits: dict = field(default_factory=dict)  # non-private estimates, shared by the cells that reuse this problem

    @property
    def trials(self) -> int:
        return self.train.q.shape[0]


def _sphere_prompts(n_trials: int, n_prompts: int, L: int, D: int, tau: float, gen, C: float | None):
    """Draw prompts and reduce them to raw features and, when C is given, clipped ones.

    Returns raw Features (n_trials, n_prompts), clipped Features or None, and how many
    responses clip_C changed. Arithmetic runs in float32, in slices of about ``_SLICE``
    numbers so the temporaries stay small; the slices share one generator, so they do not
    change the draws. Tokens are the columns of (D, L+1) blocks, as in the prompt matrix E.
    """
    raw, clipped, n_clipped = [], [], 0
    step = max(1, _SLICE // (n_prompts * (L + 1) * D))
    for s in range(0, n_trials, step):
        b = min(step, n_trials - s)
        x = torch.empty(b, n_prompts, D, L + 1).normal_(generator=gen)
        x.mul_(torch.rsqrt(x.square().sum(-2, keepdim=True)))  # uniform on the sphere
        w = torch.empty(b, n_prompts, D, 1).normal_(generator=gen)
        y = (x * w).sum(-2)  # (b, n, L+1): y_i = w.x_i
        if tau > 0:
            y += tau * torch.empty_like(y).normal_(generator=gen)
        raw.append(from_tokens(x, y))
        if C is not None:
            clipped.append(from_tokens(x, y, clip=C))
            n_clipped += int((y.abs() > C).sum())  # context and query responses
    return _cat(raw), _cat(clipped) if clipped else None, n_clipped


def _cat(parts: list[Features]) -> Features:
    return Features(*(torch.cat([getattr(p, k) for p in parts]) for k in ("q", "v", "y")))


_SLICE = 1 << 22  # numbers per generation slice (16 MB of float32)


def synthetic(const: Constants, *, trials: int, n_test: int, seed: int, chunk: int, dtype) -> Problem:
    """Chunks of trials are drawn on two threads (each chunk has its own random streams,
    so the numbers do not depend on the threading)."""
    N, L, D, C, G = const.N, const.L, const.D, const.C, const.G

    def draw(i: int):
        b = min(chunk, trials - i * chunk)
        raw, clip, nc = _sphere_prompts(b, N, L, D, const.tau, rng.generator(seed, "train", i), C)
        test, _, _ = _sphere_prompts(b, n_test, L, D, const.tau, rng.generator(seed, "test", i), None)
        return raw, clip, test, nc

    n_chunks = -(-trials // chunk)
    out = {
        "train": _empty(trials, N, D, dtype),
        "clipped": _empty(trials, N, D, dtype),
        "test": _empty(trials, n_test, D, dtype),
    }
    n_clipped = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per chunk instead of two per operation
    try:
        with ThreadPoolExecutor(max(1, min(threads, n_chunks))) as pool:
            drawn = pool.map(draw, range(n_chunks))
            for i, parts in enumerate(tqdm(drawn, total=n_chunks, desc="data", leave=False, disable=None)):
                rows = slice(i * chunk, i * chunk + parts[0].q.shape[0])
                for name, part in zip(out, parts):
                    for k in ("q", "v", "y"):
                        getattr(out[name], k)[rows] = getattr(part, k)
                n_clipped += parts[3]
    finally:
        torch.set_num_threads(threads)
    train, clipped, test = out["train"], out["clipped"], out["test"]
    digest = hashlib.sha256()
    for t in (train.q, train.v, train.y, test.q, test.v, test.y):
        digest.update(t.numpy().data)
    return Problem(
        train=train,
        private=privatize(clipped, G),
        test=test,
        clip_fraction=n_clipped / (trials * N * (L + 1)),
        projected_fraction=(clipped.norms() > G).double().mean().item(),
        fingerprint=digest.hexdigest()[:16],
    )


def _empty(trials: int, n: int, D: int, dtype) -> Features:
    return Features(torch.empty(trials, n, D, dtype=dtype), torch.empty(trials, n, D, dtype=dtype),
                    torch.empty(trials, n, dtype=dtype))


DATASETS = {"synthetic": synthetic}

_last: tuple[str, Problem] | None = None


def make_problem(cfg: DictConfig, const: Constants) -> Problem:
    """Build (or reuse) the cell's problem."""
    global _last
    dtype = getattr(torch, cfg.compute.dtype)
    key = json.dumps(
        {
            "dataset": OmegaConf.to_container(cfg.dataset, resolve=True),
            "const": [const.N, const.L, const.D, const.tau, const.C, const.G],
            "trials": cfg.trials,
            "seed": cfg.seed,
            "chunk": cfg.compute.chunk_trials,
            "dtype": cfg.compute.dtype,
        },
        sort_keys=True,
    )
    if _last is not None and _last[0] == key:
        log.info("data: reusing the prompts of the previous cell (same data config)")
        return _last[1]
    _last = None  # free the previous problem before drawing the next
    problem = DATASETS[cfg.dataset.name](
        const, trials=cfg.trials, n_test=cfg.dataset.n_test, seed=cfg.seed,
        chunk=cfg.compute.chunk_trials, dtype=dtype,
    )
    _last = (key, problem)
    return problem


def run(cfg: DictConfig, const: Constants) -> Problem:
    """The data step: build the problem and log what was generated."""
    from pipeline import tracking

    problem = make_problem(cfg, const)
    B, N, D = problem.train.shape
    tracking.log_params("data", {
        "dataset": cfg.dataset.name, "seed": cfg.seed, "trials": B, "n_test": problem.test.shape[1],
        "train_shape": f"{B}x{N}x{const.L + 1}x{D}", "test_shape": f"{B}x{problem.test.shape[1]}x{const.L + 1}x{D}",
        "fingerprint": problem.fingerprint,
    })
    tracking.log_metrics("data", {"clip_fraction": problem.clip_fraction, "projected_fraction": problem.projected_fraction})
    return problem
