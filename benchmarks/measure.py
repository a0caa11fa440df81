"""Time and peak memory of one repeated step, as every step benchmark measures them: the median
wall time over ``repeats`` calls after one warm-up (the device synchronised after each), and the
peak memory: the GPU's peak allocated memory on CUDA, and on the CPU the process's growth of its
maximum resident set over the calls (so run each measured cell in a fresh process: one cell's
peak must not hide the next's)."""

from __future__ import annotations

import resource
import statistics
import time
from typing import Callable


def measure(step: Callable[[], object], dev, repeats: int) -> tuple[float, float]:
    """(median seconds per call, peak GiB) of ``step`` on torch device ``dev``."""
    import torch

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    step()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    if dev.type == "cuda":
        return statistics.median(times), torch.cuda.max_memory_allocated(dev) / 2**30
    return statistics.median(times), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20  # KiB on Linux
