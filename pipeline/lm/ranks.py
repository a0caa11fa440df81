"""A language-model cell across processes (``train.distributed=ddp``, under torchrun): every rank
prepares the same posts and builds the same model; DP-SGD runs as one process's would
(``pipeline.dpsgd.distributed.share_steps``: one Poisson sample per step over all the posts, each
rank clipping its share of each micro-batch exactly, the clipped sums all-reduced, the noise added
once, one accountant); rank 0 alone records the run (its folder, the MLflow run, the checkpoint, the
validation, the evaluation and results.csv) and the other ranks are silent: they keep no folder of
Hydra's, log warnings only, and leave when the training ends.

    torchrun --standalone --nproc-per-node 2 -m pipeline experiment=lm_ci train.distributed=ddp

What the ranks must share, checked when they meet (``start``): the config, the archive's bytes, the
pipeline's code and the torch version; the data each prepares from them is then the same. On the
CPU the ranks talk over gloo; on CUDA over NCCL, each rank on the GPU of its ``LOCAL_RANK``. A
checkpoint is rank 0's (its folder); a relaunch resumes from it on every rank (rank 0 reads it and
sends its state). The results equal one process's to float tolerance (the clipped sums are added
in another order): tests/test_lm_distributed.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.validation import ConfigError

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets for each process
MODES = ("ddp",)


def _in_a_sweep(cfg: DictConfig) -> bool:
    """Whether ``cfg`` is a sweep's cell: its ``hydra.mode`` where the sweeper checks it up front, Hydra's
    own record inside a cell."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    mode = OmegaConf.select(cfg, "hydra.mode", default=None)
    if mode is None and HydraConfig.initialized():
        mode = HydraConfig.get().mode
    return mode in (RunMode.MULTIRUN, "MULTIRUN")


def check(distributed: str | None, cfg: DictConfig) -> None:
    """Refuse, before any folder or data, a ``train.distributed`` the environment cannot run: ddp outside
    torchrun, one process of several started by torchrun without it (each would record a run of its own),
    a sweep (each rank would run the whole sweep), and NCCL where this torch has none."""
    world = os.environ.get("WORLD_SIZE")
    if distributed is None:
        if world is not None and world != "1":
            raise ConfigError(f"train.distributed = null in one of WORLD_SIZE = {world} processes started by torchrun: "
                              "each would train and record a run of its own; set train.distributed=ddp")
        return
    missing = [k for k in TORCHRUN if k not in os.environ]
    if missing:
        raise ConfigError(f"train.distributed = {distributed!r} runs under torchrun, which sets {', '.join(TORCHRUN)} for "
                          f"each process; {', '.join(missing) if len(missing) < len(TORCHRUN) else 'none'} set here: start it as `torchrun --nproc-per-node N "
                          f"-m pipeline experiment=... train.distributed={distributed}`")
    if _in_a_sweep(cfg):
        raise ConfigError(f"train.distributed = {distributed!r} runs one cell across processes; a sweep (-m) under "
                          "torchrun would run every cell on every rank: launch each cell on its own")
    device_spec = str(OmegaConf.select(cfg, "compute.device", default="auto"))
    if device_spec.startswith("cuda"):
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise ConfigError(f"train.distributed = {distributed!r} with compute.device = {device_spec!r} needs NCCL, "
                              "which this torch was built without: use compute.device=cpu (gloo)")


def _fingerprint(cfg: DictConfig, archive: Path) -> dict:
    import torch

    from pipeline import checkpoints

    return {"config": hashlib.sha256(OmegaConf.to_yaml(cfg, resolve=True).encode()).hexdigest()[:16],
            "archive": hashlib.sha256(archive.read_bytes()).hexdigest()[:16],
            "code": checkpoints.code_hash(), "torch": torch.__version__}


def start(cfg: DictConfig, archive: Path, device_type: str) -> tuple[int, int]:
    """Join the ranks (the default process group, from torchrun's environment) and check that they run
    the same config, archive, code and torch; (rank, world). A rank other than 0 drops the folder Hydra made
    for it and logs warnings only. Ranks that differ: every rank refuses (ConfigError, no folder left)."""
    import torch.distributed as dist

    from pipeline import preflight

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _fingerprint(cfg, archive)
    found: list = [None] * world
    dist.all_gather_object(found, (mine, _folder()))
    folders = [folder for _, folder in found]
    found = [f for f, _ in found]
    differ = sorted(k for k in mine if any(f[k] != found[0][k] for f in found))
    if (rank != 0 and folders[rank] != folders[0]) or (differ and rank == 0):
        preflight.forget_run_folder()  # rank 0's folder is the run's (hydra.run.dir may name one for all); a refused
    if differ:                         # launch leaves none
        dist.destroy_process_group()
        raise ConfigError(f"the {world} ranks of train.distributed differ in their {', '.join(differ)} "
                          f"({', '.join(f'rank {r}: {f[differ[0]]}' for r, f in enumerate(found))}): every rank must "
                          "run the same config on the same archive with the same code")
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 says what the run does
    return rank, world


def _folder() -> str | None:
    from hydra.core.hydra_config import HydraConfig

    return str(Path(HydraConfig.get().runtime.output_dir).resolve()) if HydraConfig.initialized() else None


def finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
