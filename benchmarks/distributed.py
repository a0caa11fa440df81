"""Per-rank cost of one DP-SGD step across processes: step time and peak memory per rank at 1, 2 and 4
CPU processes (gloo), replicated (DDP's layout: the summed gradients all-reduced) and sharded by FSDP2
(``fully_shard`` on each block and the whole), Phantom Clipping against the non-private step of the
same model, layout and world size.

    python -m benchmarks.distributed                      # worlds 1 2 4, both layouts, on the CPU
    python -m benchmarks.distributed --world 2 --json out.json

The model is ``benchmarks/clipping.py``'s GPT-2-shaped one with its tied table (``--V``, ``--d``,
``--layers``, ``--T``); each rank steps on its share of a batch of ``--B`` examples (as
``DistributedDPSGD`` splits a Poisson sample): the non-private step is one backward pass of the
share's summed loss, the private one Phantom's (``sum_by="backward"`` under FSDP, the clipped sum
through FSDP's reduce-scatter; book-keeping when replicated), each followed by its layout's reduction
(an all-reduce of the gradients when replicated, FSDP's own reduce-scatter when sharded). Time: the
median over ``--repeats`` steps after a warm-up, the slowest rank's; memory: each rank's live-tensor
peak in a step (``benchmarks.clipping.tensor_peak``), the largest rank's. On a machine with several
GPUs, ``--device cuda`` runs the same over NCCL, one GPU a rank (not run here: no GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("non-private", "phantom")
LAYOUTS = ("replicated", "fsdp")


def _rank(rank: int, world: int, init: str, args: dict, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.nn.functional as F

    from benchmarks.clipping import build, tensor_peak
    from pipeline.clipping import PhantomClipping

    torch.set_num_threads(1)
    cuda = args["device"] == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    rows = []
    try:
        for layout in LAYOUTS:
            for engine in ENGINES:
                torch.manual_seed(0)
                model = build(args["V"], args["d"], args["layers"], args["T"], tied=True).to(dev)
                if layout == "fsdp":
                    from torch.distributed.device_mesh import init_device_mesh
                    from torch.distributed.fsdp import fully_shard

                    mesh = init_device_mesh(dev.type, (world,))
                    for block in model.blocks:
                        fully_shard(block, mesh=mesh)
                    fully_shard(model, mesh=mesh)
                    for m in model.modules():  # sums, as DistributedDPSGD sets them
                        if hasattr(m, "set_gradient_divide_factor"):
                            m.set_gradient_divide_factor(1.0)
                            m.set_force_sum_reduction_for_comms(True)
                ids = torch.randint(0, args["V"], (args["B"], args["T"] + 1), generator=torch.Generator().manual_seed(1))
                share = ids[rank::world].to(dev)

                def losses(m, batch):
                    logits = m(batch[:, :-1])
                    return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").sum(1)

                params = [p for p in model.parameters() if p.requires_grad]
                clip = PhantomClipping(model, C=1.0, sum_by="backward" if layout == "fsdp" else "bookkeeping") \
                    if engine == "phantom" else None

                def step():
                    for p in params:
                        p.grad = None
                    if clip is not None:
                        clip.step(losses, share)
                    else:
                        losses(model, share).sum().backward()
                    if layout == "replicated":
                        for p in params:  # DDP's reduction of the (clipped) sums
                            dist.all_reduce(p.grad)
                    if cuda:
                        torch.cuda.synchronize(dev)

                step()  # warm-up
                times = []
                for _ in range(args["repeats"]):
                    dist.barrier()
                    start = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - start)
                peak = tensor_peak(step, model) if not cuda else None
                found = torch.tensor([statistics.median(times), peak or 0.0], dtype=torch.float64)
                dist.all_reduce(found, op=dist.ReduceOp.MAX)  # the slowest rank's time, the largest peak
                rows.append({"layout": layout, "engine": engine, "world": world, "seconds": float(found[0]),
                             "tensor_peak_gib": float(found[1]) if not cuda else None, **args})
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _for_the_ranks(**defaults: str):
    """Environment variables the spawned ranks start with (where this process has not set them), undone
    when they end: a caller that runs ``main`` in-process keeps its own environment for what it starts
    next (the tests' fork server forks only requests whose start-up settings equal its own)."""
    unset = [k for k in defaults if k not in os.environ]
    os.environ.update({k: defaults[k] for k in unset})
    try:
        yield
    finally:
        for k in unset:
            os.environ.pop(k, None)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--V", type=int, default=8192)
    parser.add_argument("--B", type=int, default=16)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--T", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", type=Path, help="write every row here")
    a = parser.parse_args(argv)
    if a.device == "cuda" and torch.cuda.device_count() < max(a.world):
        print(f"skipped: --device cuda needs {max(a.world)} GPUs, this machine has {torch.cuda.device_count()}")
        return []
    args = {k: getattr(a, k) for k in ("V", "B", "d", "layers", "T", "repeats", "device")}
    rows = []
    print(f"{'layout':<11} {'world':>5} {'engine':<12} {'s/step':>8} {'x time':>7} {'tensors GiB':>11} {'x tensors':>9}",
          flush=True)
    for world in a.world:
        with tempfile.TemporaryDirectory() as tmp:
            init, out = f"file://{tmp}/rendezvous", f"{tmp}/rows.json"
            with _for_the_ranks(OMP_NUM_THREADS="1"):
                mp.spawn(_rank, args=(world, init, args, out), nprocs=world, join=True)
            found = json.loads(Path(out).read_text())
        for layout in LAYOUTS:
            base = next(r for r in found if r["layout"] == layout and r["engine"] == "non-private")
            for r in (r for r in found if r["layout"] == layout):
                r["time_ratio"] = r["seconds"] / base["seconds"]
                r["tensor_ratio"] = (r["tensor_peak_gib"] / base["tensor_peak_gib"]
                                     if r["tensor_peak_gib"] and base["tensor_peak_gib"] else None)
                rows.append(r)
                ratio = f"{r['tensor_ratio']:>8.2f}x" if r["tensor_ratio"] is not None else f"{'-':>9}"
                peak = f"{r['tensor_peak_gib']:>11.3f}" if r["tensor_peak_gib"] is not None else f"{'-':>11}"
                print(f"{layout:<11} {world:>5} {r['engine']:<12} {r['seconds']:>8.3f} {r['time_ratio']:>6.2f}x "
                      f"{peak} {ratio}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
