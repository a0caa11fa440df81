"""What the engine's provenance (``pipeline/clipping/provenance.py``: every operation of a step's forward
pass recorded by a ``TorchDispatchMode``, the proof that no example's loss reads another's data) costs a
Phantom step of the DPFormer stages' Transformer, against the floor any Python dispatch mode has.

    python -m benchmarks.provenance                                   # the stages' shapes (L = 20, M = 500)
    python -m benchmarks.provenance --B 32 128 --L 50 --M 3416 --json rows.json

For each (B, L, M), in one process with one torch thread, interleaved: the forward pass and per-user
losses without any mode (``plain``), under the provenance as the engine runs it (``provenance``), under
a mode that only calls each operation (``null``: what Python's dispatch alone costs), and the whole
Phantom step (forward under the provenance, norms, clipped sum, noise; ``step``). Medians of
``--repeats``. ``share``: (provenance - plain) / step; ``floor``: (null - plain) / step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Null(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def measure(B: int, L: int, M: int, repeats: int, d: int = 64) -> dict:
    from omegaconf import OmegaConf

    from pipeline.clipping.provenance import Provenance
    from pipeline.seqrec import clipping, train
    from pipeline.seqrec.clipping import user_losses

    torch.manual_seed(0)
    mcfg = OmegaConf.create(dict(arch="transformer", tied=True, d=d, heads=1, blocks=2, d_ff=4 * d, layers=1,
                                 dropout=0.2, init_std=0.02))
    model = train.build(mcfg, M, L)
    ccfg = OmegaConf.create(dict(name="phantom", rule="automatic", C=1.0, gamma=0.01, norm_form="auto",
                                 sum_by="bookkeeping"))
    engine = clipping.make("phantom", model, ccfg)
    gen = torch.Generator().manual_seed(0)
    rows = torch.multinomial(1.0 / torch.arange(1, M + 1, dtype=torch.float64), B * (L + 1), replacement=True,
                             generator=gen).view(B, L + 1) + 1
    batch = (rows[:, :-1], rows[:, 1:])
    owned = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    noise = torch.Generator().manual_seed(1)

    def plain():
        return user_losses(model, batch)

    def provenance():
        track = Provenance(B, owned)
        track.mark(batch)
        with track:
            return user_losses(model, batch)

    def null():
        with _Null():
            return user_losses(model, batch)

    def step():
        train.dp_gradient(engine, model, batch[0], batch[1], sigma=1.0, C=1.0, expected_batch=B, generator=noise)

    runs = {"plain": plain, "provenance": provenance, "null": null, "step": step}
    for f in runs.values():  # warm-up
        f()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"B": B, "L": L, "M": M, **{f"{k}_ms": round(v, 3) for k, v in ms.items()},
            "share": (ms["provenance"] - ms["plain"]) / ms["step"], "floor": (ms["null"] - ms["plain"]) / ms["step"]}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--B", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--L", type=int, nargs="+", default=[20])
    parser.add_argument("--M", type=int, nargs="+", default=[500])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, help="write every row here")
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(f"{'B':>5} {'L':>4} {'M':>6} {'plain ms':>9} {'+prov ms':>9} {'+null ms':>9} {'step ms':>9} {'share':>7} {'floor':>7}",
          flush=True)
    for M in a.M:
        for L in a.L:
            for B in a.B:
                r = measure(B, L, M, a.repeats)
                rows.append(r)
                print(f"{B:>5} {L:>4} {M:>6} {r['plain_ms']:>9.1f} {r['provenance_ms'] - r['plain_ms']:>9.1f} "
                      f"{r['null_ms'] - r['plain_ms']:>9.1f} {r['step_ms']:>9.1f} {r['share']:>6.1%} {r['floor']:>6.1%}",
                      flush=True)
    if a.json:
        import datetime

        a.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                                      "threads": 1, "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
