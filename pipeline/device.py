"""Where tensors live: ``compute.device``, resolved once, and what a run records of it.

``compute.device``: ``auto`` (the default), ``cpu``, ``cuda`` or ``cuda:N``. ``auto`` is CUDA
where torch sees one and the task runs there (``Task.devices``), else the CPU. Every refusal is a
``ConfigError`` naming the key, raised by ``check`` in ``pipeline.preflight`` before anything is
created or computed: ``cuda`` on a machine without CUDA, an unknown string, a ``cuda:N`` the
machine does not have, or a device the task cannot run on.

``configure`` applies the precision and reproducibility settings before a cell computes:
``compute.tf32`` (off by default: matmuls in full float32) and, on CUDA, torch's deterministic
algorithms where it has them (``warn_only``: an operation without one warns instead of failing;
docs/running.md, "GPUs", lists what that leaves run-to-run variable). On the CPU nothing changes: a CPU run's numbers
are those of a build without this module.
"""

from __future__ import annotations

import os
import re

from omegaconf import DictConfig

from pipeline import lazy
from pipeline.validation import ConfigError

torch = lazy.module("torch")  # imported at first use: the config's checks load this module (pipeline/lazy.py)

KEY = "compute.device"
_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def parse(spec) -> tuple[str, int | None]:
    """(kind, index) of a ``compute.device`` value; ConfigError if it is none of the forms."""
    match = _SPEC.match(str(spec)) if isinstance(spec, str) else None
    if match is None or (match.group(2) is not None and match.group(1) != "cuda"):
        raise ConfigError(f"{KEY} {spec!r} is unknown; known: auto, cpu, cuda, cuda:N")
    return match.group(1), None if match.group(2) is None else int(match.group(2))


def _unsupported(spec, supported: tuple[str, ...], what: str) -> ConfigError:
    return ConfigError(f"{KEY} = {spec!r}: {what} runs on {' or '.join(supported)} only in this release")


def check_form(spec, supported: tuple[str, ...] = ("cpu", "cuda"), what: str = "this task") -> tuple[str, int | None]:
    """``parse``, and a ConfigError where ``what`` (a task) cannot run on the kind named: the checks
    that hold on any machine. A cell that runs on another machine (a SLURM node) is checked so where
    it is submitted, and ``resolve``d where it runs."""
    kind, index = parse(spec)
    if kind != "auto" and kind not in supported:
        raise _unsupported(spec, supported, what)
    return kind, index


def resolve(spec, supported: tuple[str, ...] = ("cpu", "cuda"), what: str = "this task") -> torch.device:
    """The device ``spec`` names on this machine, for ``what`` (a task), which runs on ``supported``
    kinds; ConfigError where the machine or the task cannot honour it."""
    kind, index = check_form(spec, supported, what)
    if kind == "auto":
        kind = "cuda" if "cuda" in supported and torch.cuda.is_available() else "cpu"
        if kind not in supported:
            raise _unsupported(spec, supported, what)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{KEY} = {spec!r}: torch sees no CUDA device on this machine (torch "
                              f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use {KEY}=cpu or auto")
        count = torch.cuda.device_count()
        if index is not None and index >= count:
            raise ConfigError(f"{KEY} = {spec!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
        return torch.device("cuda", index if index is not None else torch.cuda.current_device())
    return torch.device("cpu")


def of(cfg: DictConfig, supported: tuple[str, ...] = ("cpu", "cuda"), what: str = "this task",
       here: bool = True) -> torch.device | None:
    """``resolve`` of the config's ``compute.device`` (and ``compute.tf32`` checked: true or false);
    ``here=False`` (a cell that runs on another machine): ``check_form`` only, and None."""
    compute = cfg.get("compute") or {}
    if not isinstance(compute.get("tf32", False), bool):
        raise ConfigError(f"compute.tf32 must be true or false, got {compute.get('tf32')!r}")
    if not here:
        check_form(compute.get("device", "auto"), supported, what)
        return None
    return resolve(compute.get("device", "auto"), supported, what)


def configure(cfg: DictConfig, device: torch.device) -> None:
    """Before a cell computes on ``device``: on CUDA, that device current, ``compute.tf32`` for
    matmuls and convolutions, and torch's deterministic algorithms; on the CPU, torch's defaults
    (deterministic mode off, as in a process that never saw this function)."""
    if device.type == "cuda":
        tf32 = bool((cfg.get("compute") or {}).get("tf32", False))
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode
        if device.index is not None:  # resolve's devices have one; torch.device("cuda") is the current one already
            torch.cuda.set_device(device.index)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    elif torch.are_deterministic_algorithms_enabled():  # an earlier CUDA cell of this process set it
        # Only where set: the setter imports torch._dynamo and torch._inductor (2-3 s a process)
        torch.use_deterministic_algorithms(False)


def name(device: torch.device) -> str:
    """The device's name as a run records it: the GPU's (``NVIDIA H100 80GB HBM3``), or the CPU's model
    from /proc/cpuinfo (``cpu`` where that cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() or "cpu"
    except OSError:
        pass
    return "cpu"


def free_memory(device: torch.device) -> int | None:
    """Bytes a cell can allocate on a CUDA device (None for the CPU: ``pipeline.preflight`` reads
    MemAvailable): what the driver reports free, plus what torch's caching allocator holds reserved
    but unused in this process (an earlier cell's freed tensors, which the driver counts as used:
    without them a sweep of cells in one process would refuse a cell that fits)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(cached, 0))


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float | None:
    """Peak memory in GiB: on CUDA, the largest the process's tensors held on ``device`` since
    ``reset_peak``; on the CPU, the process's peak resident set since it started (the kernel's
    ``ru_maxrss``, which cannot be reset: in a process that runs several cells, the largest so far).
    None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings of CUDA work are otherwise launch times)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
