"""Independent, reproducible random streams, one per trial.

Each stream is named (``"train"``, ``"test"``, ``"init"``, ``"noise:noisyhead"``) and every
trial has its own generator in it, seeded from ``(seed, stream, trial index)`` alone. What a
trial draws therefore does not depend on how the trials are split into chunks, on the number
of threads, or on which process runs them: ``compute.chunk_trials``, ``compute.threads`` and the
Hydra launcher change no number.

Seeds are derived by a counter-based rule, vectorised over trials: a key per (seed, stream)
from NumPy's SeedSequence, then trial t gets ``mix(key + t * 0x9E3779B9)`` with ``mix`` a
bijective 32-bit integer hash (Wellons' lowbias32). Torch's CPU generator (MT19937) keeps only
32 bits of a seed; since both steps are bijections in t, no two trials of a stream share a
generator (up to 2^32 trials).

The math stays batched over trials: only the draws loop over the trials of a chunk, each
filling its own rows of one preallocated tensor (a few microseconds per trial).

Draws are made on the CPU whatever ``compute.device`` is, and then moved (``device``): a trial's
numbers are the same draws on every device, so a CUDA run differs from the CPU run of the same
cell only by floating-point rounding in the algebra, never by its randomness.
"""

from __future__ import annotations

import zlib
from functools import lru_cache
from typing import Sequence

import numpy as np

from pipeline import lazy

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)

_GOLDEN = 0x9E3779B9  # odd: t -> key + t * _GOLDEN is a bijection mod 2^32
_MASK = 0xFFFFFFFF


@lru_cache(maxsize=256)
def _key(seed: int, stream: str) -> int:
    entropy = [seed, zlib.crc32(stream.encode())]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint32)[0])


def _mix(x: np.ndarray) -> np.ndarray:
    """lowbias32: a bijective avalanche hash of uint32 values (in uint64 arithmetic, masked)."""
    x = x & _MASK
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    x ^= x >> 16
    return x


def seeds(seed: int, stream: str, trials: range | slice) -> np.ndarray:
    """The 32-bit generator seeds of ``trials`` (absolute trial indices) in ``stream``: (len,) uint64."""
    if isinstance(trials, slice):
        trials = range(trials.start or 0, trials.stop, trials.step or 1)
    t = np.arange(trials.start, trials.stop, trials.step, dtype=np.uint64)
    return _mix(np.uint64(_key(seed, stream)) + t * np.uint64(_GOLDEN))


def generators(seed: int, stream: str, trials: range | slice) -> list[torch.Generator]:
    """One generator per trial of ``trials`` in ``stream``."""
    return [torch.Generator().manual_seed(int(s)) for s in seeds(seed, stream, trials)]


def generator(seed: int, stream: str, index: int = 0) -> torch.Generator:
    """The generator of one trial (``index``) of ``stream``."""
    return generators(seed, stream, range(index, index + 1))[0]


def randn(shape, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Standard normals drawn in float32 (several times faster on CPU than float64
    draws, and ample for Monte Carlo), returned in ``dtype`` for the algebra."""
    return torch.empty(shape, dtype=torch.float32).normal_(generator=gen).to(dtype)


def normal(gens: Sequence[torch.Generator], shape: tuple[int, ...], dtype: torch.dtype,
           device: torch.device | str | None = None) -> torch.Tensor:
    """(len(gens), *shape) standard normals, row t drawn (in float32, on the CPU) from ``gens[t]``,
    returned in ``dtype`` on ``device`` (default: the CPU)."""
    out = torch.empty(len(gens), *shape, dtype=torch.float32, device="cpu")
    for row, gen in zip(out, gens):
        row.normal_(generator=gen)
    return out.to(device=device, dtype=dtype)


def uniform(gens: Sequence[torch.Generator], shape: tuple[int, ...],
            device: torch.device | str | None = None) -> torch.Tensor:
    """(len(gens), *shape) float32 uniforms on [0, 1), row t drawn (on the CPU) from ``gens[t]``."""
    out = torch.empty(len(gens), *shape, dtype=torch.float32, device="cpu")
    for row, gen in zip(out, gens):
        row.uniform_(generator=gen)
    return out.to(device=device)


def trial_normal(seed: int, stream: str, trials: slice, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """``normal`` for the trials of a chunk, each from its own generator in ``stream``."""
    return normal(generators(seed, stream, trials), shape, dtype, device)
