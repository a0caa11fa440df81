"""The language-model task's random streams, each derived from the cell's ``seed`` and its own name
(NumPy's ``SeedSequence``): the split, the vocabulary's selection noise, the model's initial
weights, DP-SGD's Poisson sampling, DP-SGD's noise, the DP unigram model's noise and the offsets of
``dataset.examples=post_window``'s windows never share
bits, within a seed or across seeds (seed s's noise is not seed s + 1's initialisation). Sampling
and noise are apart so that a tied and an untied cell of one seed (whose noise draws differ in
number: the untied model has V d more coordinates) are trained on the same Poisson batches.

As everywhere in the project, the seed is logged and every run replays bit for bit; the guarantee
assumes the noise is secret (docs/privacy.md: randomness).
"""

from __future__ import annotations

import zlib

import numpy as np

NAMES = ("split", "vocab", "init", "sampling", "noise", "unigram", "windows")


def seed_of(seed: int, name: str) -> int:
    """A 63-bit seed for stream ``name`` of cell seed ``seed`` (torch's and NumPy's generators take it)."""
    if name not in NAMES:
        raise ValueError(f"unknown stream {name!r}; known: {NAMES}")
    state = np.random.SeedSequence([int(seed) % 2**64, zlib.crc32(name.encode())]).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1
