"""Time and peak memory of one DP-SGD training step of the next-item Transformer, per clipping engine.

    python -m benchmarks.seqrec_step                       # the default grid (long on 2 CPU cores)
    python -m benchmarks.seqrec_step --B 64 256 --L 50 --M 3416 23715 --repeats 5

Engines: ``none`` (non-private), ``phantom`` (book-keeping sum), ``phantom/backward`` (second backward
pass) and ``per_sample`` on the tied Transformer, ``ghost`` on
the untied Transformer at d and at d/2 (the paper's footnote 5). Each (engine, B, L, M) runs in its
own process: one warm-up step, then the median of ``--repeats`` timed steps (forward, clipped sum,
noise, Adam). Peak memory: on CPU the growth of the process's peak resident set over its size
before the first step (``ru_maxrss``), on CUDA ``max_memory_allocated`` minus the memory allocated
before the first step. A combination whose estimated memory exceeds ``--mem-gb`` is skipped and
listed as such. Ratios are to the non-private step of the same (B, L, M). Item ids are drawn from
a Zipf law (repeats within a sequence), a quarter of the positions left-padded.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ENGINES = [("none", "transformer"), ("phantom", "transformer"), ("phantom/backward", "transformer"),
           ("per_sample", "transformer"),
           ("ghost", "transformer_untied"), ("ghost", "transformer_untied_half")]


def estimate_gb(engine: str, model: str, B: int, L: int, M: int, d: int = 64) -> float:
    """A rough upper estimate of a step's memory: the (B, L, M) scores and their gradients (about 4
    copies), per-user (M, d) gradients for per_sample (twice), (B, L, L) Grams for the ghost norms."""
    f = 4 / 2**30
    est = 4 * B * L * M * f
    if engine == "per_sample":
        est += 2 * B * (M + 1) * d * f
    if engine in ("phantom", "ghost"):
        est += B * L * M * f + 8 * B * L * L * f
    return est


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(engine: str, model_name: str, B: int, L: int, M: int, repeats: int, threads: int | None) -> dict:
    import warnings

    import torch
    from omegaconf import OmegaConf

    from pipeline.seqrec import clipping, models, train

    warnings.filterwarnings("ignore")
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    d = 32 if model_name.endswith("_half") else 64
    mcfg = OmegaConf.create(dict(arch="transformer", tied=model_name == "transformer", d=d, heads=1, blocks=2,
                                 d_ff=4 * d, layers=1, dropout=0.2, init_std=0.02))
    model = models.build(mcfg, M, L).to(dev)
    name, _, sum_by = engine.partition("/")  # phantom/backward: the clipped sum by a second backward pass
    ccfg = OmegaConf.create(dict(name=name, rule="automatic", C=1.0, gamma=0.01, norm_form="auto",
                                 sum_by=sum_by or "bookkeeping"))
    eng = clipping.make(name, model, ccfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-5)
    gen = torch.Generator().manual_seed(0)
    zipf = 1.0 / torch.arange(1, M + 1, dtype=torch.float64)
    rows = torch.multinomial(zipf, B * (L + 1), replacement=True, generator=gen).view(B, L + 1) + 1
    pad = torch.rand(B, generator=gen) < 0.5
    rows[pad, : L // 2] = 0  # half the users have half their positions padded
    rows = rows.to(dev)
    noise_gen = torch.Generator(device=dev).manual_seed(1)
    sigma = 0.0 if engine == "none" else 1.0

    def step():
        train.noisy_gradient(eng, model, rows[:, :-1], rows[:, 1:], sigma=sigma, C=1.0, expected_batch=B,
                             generator=noise_gen)
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()

    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = rss_bytes()
    step()  # warm-up (the same peak as a timed step)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"seconds": statistics.median(times), "peak_gb": peak / 2**30, "device": str(dev),
            "threads": torch.get_num_threads()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--L", type=int, nargs="+", default=[50, 200])
    ap.add_argument("--M", type=int, nargs="+", default=[3416, 23715])
    ap.add_argument("--engines", nargs="+", default=[f"{e}:{m}" for e, m in ENGINES],
                    help="engine:model pairs")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--mem-gb", type=float, default=8.0, help="skip combinations estimated above this")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--worker", nargs=5, metavar=("ENGINE", "MODEL", "B", "L", "M"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        e, m, B, L, M = args.worker
        print(json.dumps(worker(e, m, int(B), int(L), int(M), args.repeats, args.threads)))
        return
    rows = []
    print(f"{'B':>5} {'L':>4} {'M':>6} {'engine':>11} {'model':>24} {'s/step':>9} {'peak GB':>8} "
          f"{'time x':>7} {'mem x':>7}")
    for M in args.M:
        for L in args.L:
            for B in args.B:
                ref = None
                for pair in args.engines:
                    engine, model = pair.split(":")
                    row = {"B": B, "L": L, "M": M, "engine": engine, "model": model}
                    est = estimate_gb(engine, model, B, L, M)
                    if est > args.mem_gb:
                        row["skipped"] = f"estimated {est:.1f} GB > --mem-gb {args.mem_gb:g}"
                    else:
                        cmd = [sys.executable, "-m", "benchmarks.seqrec_step", "--worker", engine, model, str(B),
                               str(L), str(M), "--repeats", str(args.repeats)]
                        if args.threads:
                            cmd += ["--threads", str(args.threads)]
                        proc = subprocess.run(cmd, capture_output=True, text=True)
                        if proc.returncode:
                            row["skipped"] = "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:120]
                        else:
                            row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                    if engine == "none" and "seconds" in row:
                        ref = row
                    if "seconds" in row and ref is not None:
                        row["time_ratio"] = row["seconds"] / ref["seconds"]
                        row["mem_ratio"] = row["peak_gb"] / max(ref["peak_gb"], 1e-9)
                    rows.append(row)
                    if "skipped" in row:
                        print(f"{B:>5} {L:>4} {M:>6} {engine:>11} {model:>24}   skipped: {row['skipped']}")
                    else:
                        print(f"{B:>5} {L:>4} {M:>6} {engine:>11} {model:>24} {row['seconds']:>9.3f} "
                              f"{row['peak_gb']:>8.3f} {row.get('time_ratio', float('nan')):>7.2f} "
                              f"{row.get('mem_ratio', float('nan')):>7.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
