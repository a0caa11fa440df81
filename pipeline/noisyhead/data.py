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
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from pipeline import lazy, rng
from pipeline.noisyhead.constants import Constants
from pipeline.noisyhead.features import Features, from_tokens, privatize

if TYPE_CHECKING:
    from torch import Tensor

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)

log = logging.getLogger(__name__)


@dataclass
class Tokens:
    """Raw tokens of k chosen training prompts per trial (the ones an attack replaces)."""

    index: Tensor  # (B, k) positions of the prompts among the N
    x: Tensor  # (B, k, D, L+1) tokens as columns
    y: Tensor  # (B, k, L+1) responses


@dataclass
class Problem:
    """One cell's data, batched over B trials."""

    train: Features  # raw features Z_k and responses y_{k,L+1}: ridge oracle, non-private GD
    private: Features  # Z~_k = Pi_G(q clip_C-v^T) and clip_C(y_{k,L+1}): NoisyHead
    test: Features  # fresh, unclipped test prompts
    clip_fraction: float  # share of training responses y_{k,i} that clip_C changed
    projected_fraction: float  # share of training features that Pi_G shrank
    fingerprint: str  # sha256 (prefix) of the raw train and test tensors
    kept: Tokens | None = None  # raw tokens of the prompts an attack will perturb
    fits: dict = field(default_factory=dict)  # estimates, shared by the cells that reuse this problem

    @property
    def trials(self) -> int:
        return self.train.q.shape[0]

    def to(self, device) -> "Problem":
        """The problem on ``device``: its features and kept tokens moved there (on the device they are
        on already, the problem itself). Everything is drawn on the CPU (``pipeline.rng``), so every
        device holds the same numbers."""
        if self.train.q.device == torch.device(device):
            return self
        kept = None if self.kept is None else Tokens(*(t.to(device) for t in (self.kept.index, self.kept.x, self.kept.y)))
        return Problem(train=self.train.to(device), private=self.private.to(device), test=self.test.to(device),
                       clip_fraction=self.clip_fraction, projected_fraction=self.projected_fraction,
                       fingerprint=self.fingerprint, kept=kept)


def _sphere_prompts(n_prompts: int, L: int, D: int, tau: float, gens, C: float | None, raw: Features,
                    clipped: Features | None = None, keep: Tensor | None = None, scratch: Tensor | None = None):
    """Draw ``raw.y.numel()`` prompts, trial t of the rows from its own generator ``gens[t]``, and
    write their features into ``raw`` and, when C is given, their clipped features into ``clipped``
    (both (n_trials, n_prompts) views of the outputs, in any dtype). Returns how many responses
    clip_C changed and the raw tokens of the prompts that ``keep`` (n_trials, k) names.

    Each trial's prompts are drawn in segments of at most ``_slice_prompts`` prompts at fixed
    offsets within the trial (tokens, then tasks, then response noise, per segment), so that what
    a trial draws depends on nothing but its generator: not on the chunk it is in. Consecutive
    segments are packed into slices of at most that many prompts, each drawn into ``scratch``,
    reused from slice to slice and call to call, so that no slice pays for fresh pages, and turned
    into features ``_BLOCK`` prompts at a time, so that the temporaries stay in the core's cache.
    Tokens are the columns of (D, L+1) blocks, as in E.
    """
    n_trials = raw.y.shape[0]
    total = n_trials * n_prompts
    raw = raw.reshape(total)
    clipped = clipped.reshape(total) if clipped is not None else None
    n_clipped = 0
    wanted = None if keep is None else (torch.arange(n_trials).unsqueeze(1) * n_prompts + keep).flatten()
    ascending = None if wanted is None else wanted.sort().values
    if wanted is not None:  # filled in increasing position
        kept_x, kept_y, n_kept = torch.empty(len(wanted), D, L + 1), torch.empty(len(wanted), L + 1), 0
    step = _slice_prompts(L, D)
    scratch = _scratch(L, D, scratch)
    block = scratch[-_BLOCK * D * (L + 1):].view(_BLOCK, D, L + 1)  # after the slice's tokens
    for start, m, segments in _slices(n_trials, n_prompts, step):
        x = scratch[: m * D * (L + 1)].view(m, D, L + 1)
        w = torch.empty(m, D, 1)
        e = torch.empty(m, L + 1) if tau > 0 else None
        for t, lo, hi in segments:  # positions [lo, hi) of the slice are prompts of trial t
            x[lo:hi].normal_(generator=gens[t])
            w[lo:hi].normal_(generator=gens[t])
            if e is not None:
                e[lo:hi].normal_(generator=gens[t])
        y = torch.empty(m, L + 1)
        for b in range(0, m, _BLOCK):
            blk = slice(b, min(b + _BLOCK, m))
            xb, tmp = x[blk], block[: blk.stop - b]
            xb.mul_(torch.rsqrt(torch.square(xb, out=tmp).sum(-2, keepdim=True)))  # uniform on the sphere
            yb = torch.sum(torch.mul(xb, w[blk], out=tmp), -2, out=y[blk])  # y_i = w.x_i
            if e is not None:
                yb += tau * e[blk]
            _fill(raw, start + b, from_tokens(xb, yb))
            if clipped is not None:
                _fill(clipped, start + b, from_tokens(xb, yb, clip=C))
        if clipped is not None:
            n_clipped += int((y.abs() > C).sum())  # context and query responses
        if wanted is not None:
            here = ascending[(ascending >= start) & (ascending < start + m)] - start
            kept_x[n_kept : n_kept + len(here)], kept_y[n_kept : n_kept + len(here)] = x[here], y[here]
            n_kept += len(here)
    kept = None
    if wanted is not None:  # back in the order of ``keep``: element i is the rank(i)-th in position
        order = wanted.argsort().argsort()
        kept = (kept_x[order].reshape(*keep.shape, D, L + 1), kept_y[order].reshape(*keep.shape, L + 1))
    return n_clipped, kept


def _slices(n_trials: int, n_prompts: int, step: int):
    """(flat start, length, [(trial, a, b), ...]): each trial's prompts cut into segments of at most
    ``step`` at offsets 0, step, 2 step, ... within the trial, packed in order into slices of at
    most ``step`` prompts; segment (t, a, b) is positions [a, b) of its slice."""
    start, m, segments = 0, 0, []
    for t in range(n_trials):
        for offset in range(0, n_prompts, step):
            k = min(step, n_prompts - offset)
            if m + k > step:
                yield start, m, segments
                start, m, segments = start + m, 0, []
            segments.append((t, m, m + k))
            m += k
    if m:
        yield start, m, segments


def _fill(out: Features, start: int, part: Features) -> None:
    rows = slice(start, start + part.y.shape[0])
    out.q[rows], out.v[rows], out.y[rows] = part.q, part.v, part.y


_SLICE = 1 << 22  # numbers per generation slice (16 MB of float32); fixes the order of a trial's draws
_BLOCK = 4096  # prompts per block of the feature computation (640 kB of float32 tokens)


def _slice_prompts(L: int, D: int) -> int:
    return max(1, _SLICE // ((L + 1) * D))


def _scratch(L: int, D: int, buffer: Tensor | None = None) -> Tensor:
    """Float32 room for one slice of tokens and one block of temporaries: ``buffer`` when it is
    large enough, else a new one."""
    numel = (_slice_prompts(L, D) + _BLOCK) * D * (L + 1)
    return buffer if buffer is not None and buffer.numel() >= numel else torch.empty(numel)


def synthetic(const: Constants, *, trials: int, n_test: int, seed: int, chunk: int, dtype, keep: int = 0,
              dataset=None) -> Problem:
    """Chunks of trials are drawn on the worker threads, each writing its rows of the outputs
    (every trial has its own random streams, so the numbers depend neither on the chunks nor on
    the threading). ``keep`` > 0 also keeps the raw tokens of that many prompts per trial, chosen
    uniformly without replacement (stream "attack"). The fingerprint hashes each trial's features."""
    N, L, D, C, G = const.N, const.L, const.D, const.C, const.G
    out = {
        "train": _empty(trials, N, D, dtype=dtype),
        "clipped": _empty(trials, N, D, dtype=dtype),
        "test": _empty(trials, n_test, D, dtype=dtype),
    }
    local = threading.local()  # one scratch buffer per worker thread

    def draw(i: int):
        rows = slice(i * chunk, min((i + 1) * chunk, trials))
        b = rows.stop - rows.start
        index = None
        if keep:
            index = rng.uniform(rng.generators(seed, "attack", rows), (N,)).argsort(-1)[:, :keep]
        local.scratch = _scratch(L, D, getattr(local, "scratch", None))
        train, test = out["train"][rows], out["test"][rows]
        nc, kept = _sphere_prompts(N, L, D, const.tau, rng.generators(seed, "train", rows), C, train,
                                   out["clipped"][rows], index, local.scratch)
        _sphere_prompts(n_test, L, D, const.tau, rng.generators(seed, "test", rows), None, test,
                        scratch=local.scratch)
        parts = [t.numpy() for t in (train.q, train.v, train.y, test.q, test.v, test.y)]
        digests = []
        for t in range(b):  # per trial, so that the fingerprint does not depend on the chunks
            digest = hashlib.sha256()
            for part in parts:
                digest.update(part[t].data)
            digests.append(digest.digest())
        return nc, (index, kept), b"".join(digests)

    n_chunks = -(-trials // chunk)
    n_clipped, kept, digest = 0, [], hashlib.sha256()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per chunk instead of two per operation
    try:
        with ThreadPoolExecutor(max(1, min(threads, n_chunks))) as pool:
            drawn = pool.map(draw, range(n_chunks))
            for nc, k, d in tqdm(drawn, total=n_chunks, desc="data", leave=False, disable=None):
                n_clipped += nc
                kept.append(k)
                digest.update(d)
    finally:
        torch.set_num_threads(threads)
    kept = Tokens(torch.cat([k[0] for k in kept]), torch.cat([k[1][0] for k in kept]).to(dtype),
                  torch.cat([k[1][1] for k in kept]).to(dtype)) if keep else None
    return _problem(out, G=G, clipped_share=n_clipped / (trials * N * (L + 1)),
                    fingerprint=digest.hexdigest()[:16], kept=kept)


def _problem(out: dict[str, Features], *, G: float, clipped_share: float, fingerprint: str,
             kept: Tokens | None = None) -> Problem:
    """The problem from its raw, clipped and test features: the private view projects at G."""
    return Problem(
        train=out["train"],
        private=privatize(out["clipped"], G),
        test=out["test"],
        clip_fraction=clipped_share,
        projected_fraction=(out["clipped"].norms() > G).double().mean().item(),
        fingerprint=fingerprint,
        kept=kept,
    )


def _empty(*shape_and_D: int, dtype) -> Features:
    """Uninitialised features of leading shape ``shape_and_D[:-1]`` and dimension D."""
    *shape, D = shape_and_D
    return Features(torch.empty(*shape, D, dtype=dtype), torch.empty(*shape, D, dtype=dtype),
                    torch.empty(*shape, dtype=dtype))


def newsgroups(const: Constants, *, trials: int, n_test: int, seed: int, chunk: int, dtype, keep: int = 0,
               dataset=None) -> Problem:
    """Prompts of 20 Newsgroups articles (``pipeline/noisyhead/newsgroups.py``). Every trial draws a fresh
    grouping: each prompt takes one newsgroup uniformly at random and L+1 of its articles
    without replacement (the last is the query), training prompts from the train split and
    test prompts from the test split. An article can serve several prompts of a trial (there
    are 11,314 training articles for 822 x 31 places), so one article's privacy is that of
    the prompts it appears in (group privacy)."""
    from pipeline.noisyhead import newsgroups as ng

    corpus = ng.articles(dataset)
    N, L, D, C, G = const.N, const.L, const.D, const.C, const.G
    if corpus.x["train"].shape[1] != D:
        raise ValueError(f"the feature file has D = {corpus.x['train'].shape[1]}, the regime D = {D}")
    out = {"train": _empty(trials, N, D, dtype=dtype), "clipped": _empty(trials, N, D, dtype=dtype),
           "test": _empty(trials, n_test, D, dtype=dtype)}
    n_clipped = 0
    for i, start in enumerate(range(0, trials, chunk)):
        b = min(chunk, trials - start)
        for split, name, n in (("train", "train", N), ("test", "test", n_test)):
            gens = rng.generators(seed, f"grouping:{split}", slice(start, start + b))
            idx = _group_prompts(corpus.group[split], gens, n, L + 1)  # (b, n, L+1) article indices
            x = torch.from_numpy(corpus.x[split]).float()[idx].transpose(-1, -2)  # tokens as columns
            y = torch.from_numpy(corpus.y[split]).float()[idx]
            _fill(out[name], start, from_tokens(x, y))
            if split == "train":
                _fill(out["clipped"], start, from_tokens(x, y, clip=C))
                n_clipped += int((y.abs() > C).sum())
    return _problem(out, G=G, clipped_share=n_clipped / (trials * N * (L + 1)),
                    fingerprint=ng.fingerprint(corpus) + f":seed={seed}")


def _group_prompts(groups, gens, n: int, size: int) -> Tensor:
    """(len(gens), n, size) article indices, trial t drawn from ``gens[t]``: per prompt a newsgroup
    uniformly at random, then ``size`` of its articles without replacement (the ``size`` smallest
    of uniform keys over the group's articles)."""
    import numpy as np

    labels = np.unique(groups)
    sizes = torch.tensor([int((groups == g).sum()) for g in labels])
    members = torch.zeros(len(labels), int(sizes.max()), dtype=torch.long)  # padded member lists
    for g, label in enumerate(labels):
        members[g, : sizes[g]] = torch.from_numpy(np.flatnonzero(groups == label))
    if int(sizes.min()) < size:
        raise ValueError(f"a newsgroup has {int(sizes.min())} articles, fewer than the {size} a prompt takes")
    out = torch.empty(len(gens), n, size, dtype=torch.long)
    outside = torch.arange(members.shape[1])
    for t, gen in enumerate(gens):
        choice = torch.randint(len(labels), (n,), generator=gen)
        keys = torch.rand(n, members.shape[1], generator=gen)
        keys[outside >= sizes[choice].unsqueeze(1)] = 2.0  # never among the smallest
        picks = keys.topk(size, largest=False, sorted=True).indices
        out[t] = members[choice.unsqueeze(1), picks]
    return out


DATASETS = {"synthetic": synthetic, "newsgroups": newsgroups}

_last: tuple[str, Problem] | None = None


def attack_prompts(cfg: DictConfig) -> int:
    """How many prompts per trial the configured attack perturbs (their tokens are kept)."""
    return int(cfg.attack.prompts) if cfg.attack.name != "none" else 0


def _key(cfg: DictConfig, const: Constants, device: torch.device | str) -> str:
    """What a cell's problem depends on: two cells with the same key share one problem."""
    return json.dumps(
        {
            "dataset": OmegaConf.to_container(cfg.dataset, resolve=True),
            "const": [const.N, const.L, const.D, const.tau, const.C, const.G],
            "trials": cfg.trials,
            "seed": cfg.seed,
            "dtype": cfg.compute.dtype,
            "keep": attack_prompts(cfg),
            "device": str(device),
        },
        sort_keys=True,
    )


def held_bytes(device: torch.device | str) -> int:
    """Bytes of the previous cell's problem on ``device`` (its prompts, kept tokens and remembered
    estimates, each storage once): memory the next cell reuses (the same data) or frees before it
    draws its own, so that its memory check may count it as available."""
    if _last is None:
        return 0
    device, storages = torch.device(device), {}

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            if x.device == device:
                storage = x.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(x, dict):
            for value in x.values():
                walk(value)
        elif isinstance(x, (list, tuple)):
            for value in x:
                walk(value)
        elif is_dataclass(x):
            for f in fields(x):
                walk(getattr(x, f.name))

    walk(_last[1])
    return sum(storages.values())


def release_unless_reused(cfg: DictConfig, const: Constants, device: torch.device | str) -> None:
    """Free the previous cell's problem unless this cell reuses it: before the cell's peak memory is
    reset, so that the peak a cell logs is its own."""
    global _last
    if _last is not None and _last[0] != _key(cfg, const, device):
        _last = None


def make_problem(cfg: DictConfig, const: Constants, device: torch.device | str = "cpu") -> Problem:
    """Build (or reuse) the cell's problem, drawn on the CPU and placed on ``device``."""
    global _last
    dtype = getattr(torch, cfg.compute.dtype)
    key = _key(cfg, const, device)
    if _last is not None and _last[0] == key:
        log.info("data: reusing the prompts of the previous cell (same data config)")
        return _last[1]
    release_unless_reused(cfg, const, device)  # free the previous problem before drawing the next
    problem = DATASETS[cfg.dataset.name](
        const, trials=cfg.trials, n_test=cfg.dataset.n_test, seed=cfg.seed,
        chunk=cfg.compute.chunk_trials, dtype=dtype, keep=attack_prompts(cfg), dataset=cfg.dataset,
    ).to(device)  # the one place NoisyHead's tensors move to a GPU
    _last = (key, problem)
    return problem


def run(cfg: DictConfig, const: Constants, device: torch.device | str = "cpu") -> Problem:
    """The data step: build the problem on ``device`` and log what was generated."""
    from pipeline import tracking

    problem = make_problem(cfg, const, device)
    B, N, D = problem.train.shape
    tracking.log_params("data", {
        "dataset": cfg.dataset.name, "seed": cfg.seed, "trials": B, "n_test": problem.test.shape[1],
        "train_shape": f"{B}x{N}x{const.L + 1}x{D}", "test_shape": f"{B}x{problem.test.shape[1]}x{const.L + 1}x{D}",
        "fingerprint": problem.fingerprint,
    })
    tracking.log_metrics("data", {"clip_fraction": problem.clip_fraction, "projected_fraction": problem.projected_fraction})
    return problem
