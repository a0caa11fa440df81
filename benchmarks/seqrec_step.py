"""Time and peak memory of one DP-SGD training step of the next-item Transformer, per clipping engine.

    python -m benchmarks.seqrec_step                       # the default grid (long on 2 CPU cores)
    python -m benchmarks.seqrec_step --B 64 256 --L 50 --M 3416 23715 --repeats 5
    python -m benchmarks.seqrec_step ... --json rows.json --figure efficiency.png   # also the rows, Figure 3
    python -m benchmarks.seqrec_step --from-json rows.json --figure efficiency.png  # redraw, no timing

Engines: ``none`` (non-private), ``phantom`` (book-keeping sum), ``phantom/backward`` (second backward
pass) and ``per_sample`` on the tied Transformer, ``ghost`` on
the untied Transformer at d and at d/2 (the paper's footnote 5). Each (engine, B, L, M) runs in its
own process: one warm-up step, then the median of ``--repeats`` timed steps (forward, clipped sum,
noise, Adam). Peak memory: on CPU the growth of the process's peak resident set over its size
before the first step (``ru_maxrss``), on CUDA ``max_memory_allocated`` minus the memory allocated
before the first step. A combination whose estimated memory exceeds ``--mem-gb`` (default: 8 GB
on the CPU, 90% of the GPU's memory on CUDA) is skipped and listed as such. Ratios are to the
non-private step of the same (B, L, M). Item ids are drawn from a Zipf law (repeats within a
sequence), a quarter of the positions left-padded.

``--figure`` draws the paper's Figure 3 comparison from the rows (``figure``): time per step and
peak memory of each private engine over the non-private step's, against the item count M and
against the batch size B.
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
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

ENGINES = [("none", "transformer"), ("phantom", "transformer"), ("phantom/backward", "transformer"),
           ("per_sample", "transformer"),
           ("ghost", "transformer_untied"), ("ghost", "transformer_untied_half")]


# Legend names of the (engine, model) pairs; d is the worker's model width (64, or 32 for ``_half``).
LABELS = {("none", "transformer"): "non-private",
          ("phantom", "transformer"): "Phantom (tied)",
          ("phantom/backward", "transformer"): "Phantom, second backward (tied)",
          ("per_sample", "transformer"): "per-sample gradients (tied)",
          ("ghost", "transformer_untied"): r"Ghost (untied, $d = 64$)",
          ("ghost", "transformer_untied_half"): r"Ghost (untied, $d = 32$)"}
COLORS = dict(zip(LABELS.values(), ["black", "tab:red", "tab:orange", "tab:blue", "tab:green", "tab:olive"]))
CELL = ["B", "L", "M"]


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def ratios(rows: list[dict]) -> pd.DataFrame:
    """One row per timed (engine, model, B, L, M): its ``seconds`` and ``peak_gb`` over those of the
    non-private (``none``) step of the same (B, L, M) (``time_ratio``, ``mem_ratio``; NaN where that
    step is missing or its peak is not positive), and its legend name (``series``). Skipped rows are
    dropped."""
    import pandas as pd

    df = pd.DataFrame([r for r in rows if "seconds" in r], columns=[*CELL, "engine", "model", "seconds", "peak_gb"])
    ref = df[df["engine"] == "none"].drop_duplicates(CELL)[[*CELL, "seconds", "peak_gb"]]
    df = df.merge(ref, on=CELL, how="left", suffixes=("", "_ref"))
    df["time_ratio"] = df["seconds"] / df["seconds_ref"]
    df["mem_ratio"] = df["peak_gb"] / df["peak_gb_ref"].where(df["peak_gb_ref"] > 0)
    df["series"] = [LABELS.get((e, m), f"{e} ({m})") for e, m in zip(df["engine"], df["model"])]
    return df.drop(columns=["seconds_ref", "peak_gb_ref"])


def figure(rows: list[dict], path: Path) -> Path:
    """Figure 3's comparison: time per step (top) and peak memory (bottom) over the non-private step,
    one line per private engine, against M at the largest B (left) and against B at the largest M
    (right), both at the largest L; a column is left out when its variable takes one value only.
    Raises ValueError when no row has a non-private reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipeline.plot import save

    df = ratios(rows)
    df = df[(df["engine"] != "none") & df["time_ratio"].notna()]
    if df.empty:
        raise ValueError("no timed private row has a timed non-private (engine none) row of the same B, L, M")
    df = df[df["L"] == df["L"].max()]
    L = int(df["L"].iloc[0])
    columns = [x for x in ("M", "B") if df[x].nunique() > 1] or ["B"]
    names = {"M": "$M$ (items, log scale)", "B": "$B$ (batch size, log scale)"}
    measures = {"time_ratio": "time per step / non-private", "mem_ratio": "peak memory / non-private"}
    fig, axes = plt.subplots(2, len(columns), figsize=(5.2 * len(columns), 7.0), squeeze=False)
    for j, x in enumerate(columns):
        other = "B" if x == "M" else "M"
        fixed = df[other].max()
        sub = df[df[other] == fixed]
        for i, y in enumerate(measures):
            ax = axes[i][j]
            ax.axhline(1.0, color="grey", ls="--", lw=1, label="non-private (= 1)")
            for series, g in sub.groupby("series", sort=False):
                g = g.sort_values(x)
                ax.plot(g[x], g[y], marker="o", ms=5, label=series, color=COLORS.get(series))
            values = sorted(sub[x].unique())
            ax.set_xscale("log")
            ax.set_xticks(values, [f"{v:,}" for v in values])
            ax.minorticks_off()
            top = sub[y].max()
            if top / max(sub[y].min(), 1e-12) > 20:
                ax.set_yscale("log")
            else:
                ax.set_ylim(0, max(top, 1.0) * 1.12)
            ax.set_ylabel(measures[y])
            ax.grid(alpha=0.3)
            if i == 0:
                number = f"{fixed:,}".replace(",", "{,}")  # a thousands comma, not a math-mode list comma
                ax.set_title(f"${other} = {number}$, $L = {L}$", fontsize=10)
            else:
                ax.set_xlabel(names[x])
    seen = {}
    for ax in axes.flat:
        for h, n in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(n, h)
    ncol = min(len(seen), 4)  # four entries a line (the non-private line and three engines)
    nrows = -(-len(seen) // ncol)
    fig.legend(list(seen.values()), list(seen.keys()), loc="lower center", ncol=ncol, fontsize=8,
               frameon=False)  # below the panels: it never covers data
    device = {str(r.get("device")) for r in rows if "device" in r}
    threads = {str(r.get("threads")) for r in rows if "threads" in r}
    fig.suptitle(f"One DP-SGD step relative to the non-private step ({', '.join(sorted(device)) or '?'}, "
                 f"{'/'.join(sorted(threads)) or '?'} thread(s))", fontsize=10)
    fig.tight_layout(rect=(0, 0.035 * nrows + 0.01, 1, 1))
    return save(fig, Path(path))


def estimate_gb(engine: str, model: str, B: int, L: int, M: int, d: int = 64) -> float:
    """A rough upper estimate of a step's memory: the (B, L, M) scores and their gradients (about 4
    copies), per-user (M, d) gradients for per_sample (twice), (B, L, L) Grams for the ghost norms."""
    f = 4 / 2**30
    est = 4 * B * L * M * f
    if engine == "per_sample":
        est += 2 * B * (M + 1) * d * f
    if engine.split("/")[0] in ("phantom", "ghost"):  # phantom/backward too
        est += B * L * M * f + 8 * B * L * L * f
    return est


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(engine: str, model_name: str, B: int, L: int, M: int, repeats: int, threads: int | None,
           device_spec: str = "auto") -> dict:
    import warnings

    import torch
    from omegaconf import OmegaConf

    from pipeline.seqrec import clipping, train

    warnings.filterwarnings("ignore")
    if threads:
        torch.set_num_threads(threads)
    from pipeline import device

    dev = device.resolve(device_spec)  # auto: CUDA where torch sees one (torch's default math: no deterministic mode)
    torch.manual_seed(0)
    d = 32 if model_name.endswith("_half") else 64
    mcfg = OmegaConf.create(dict(arch="transformer", tied=model_name == "transformer", d=d, heads=1, blocks=2,
                                 d_ff=4 * d, layers=1, dropout=0.2, init_std=0.02))
    model = train.build(mcfg, M, L).to(dev)
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
        train.dp_gradient(eng, model, rows[:, :-1], rows[:, 1:], sigma=sigma, C=1.0, expected_batch=B,
                             generator=noise_gen)
        opt.step()
        device.synchronize(dev)

    if dev.type == "cuda":  # every CUDA call on dev (cuda:N), not on the current device
        device.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        device.reset_peak(dev)
    else:
        base = rss_bytes()
    step()  # warm-up (the same peak as a timed step)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) - base
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
    ap.add_argument("--device", default="auto", help="auto (CUDA where torch sees one), cpu, cuda or cuda:N")
    ap.add_argument("--mem-gb", type=float, default=None,
                    help="skip combinations estimated above this (default: 8 on the CPU, 90%% of a GPU's memory)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--figure", default=None, help="also draw Figure 3 (ratios to the non-private step) here, PNG")
    ap.add_argument("--from-json", default=None, help="no timing: draw --figure from rows saved by --json")
    ap.add_argument("--worker", nargs=5, metavar=("ENGINE", "MODEL", "B", "L", "M"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        e, m, B, L, M = args.worker
        print(json.dumps(worker(e, m, int(B), int(L), int(M), args.repeats, args.threads, args.device)))
        return
    if args.from_json:
        if not args.figure:
            fail(f"--figure: --from-json {args.from_json} needs a --figure path to draw")
        try:
            with open(args.from_json) as fh:
                saved = json.load(fh)
        except (OSError, ValueError) as err:
            fail(f"--from-json: cannot read rows from {args.from_json!r}: {err}")
        if not isinstance(saved, list) or not all(isinstance(r, dict) for r in saved):
            fail(f"--from-json: {args.from_json!r} does not hold a list of rows")
        try:
            print(figure(saved, Path(args.figure)))
        except (KeyError, ValueError) as err:
            fail(f"--from-json: {args.from_json!r}: {err}")
        return
    for key in ("B", "L", "M"):
        if min(getattr(args, key)) < 1:
            fail(f"--{key} must be positive integers, got {getattr(args, key)}")
    if args.repeats < 1:
        fail(f"--repeats must be a positive integer, got {args.repeats}")
    from pipeline import device
    from pipeline.validation import ConfigError

    try:
        dev = device.resolve(args.device)
    except ConfigError as err:
        fail(f"--device: {err}")
    if args.mem_gb is None:
        import torch

        args.mem_gb = 0.9 * torch.cuda.get_device_properties(dev).total_memory / 2**30 if dev.type == "cuda" else 8.0
    engines, models = {e for e, _ in ENGINES}, {m for _, m in ENGINES}
    for pair in args.engines:
        engine, _, model = pair.partition(":")
        if engine not in engines or model not in models:
            fail(f"--engines: {pair!r} is not ENGINE:MODEL with ENGINE in {sorted(engines)}, MODEL in {sorted(models)}")
    if args.figure and "none:transformer" not in args.engines:
        fail("--figure: the ratios need the non-private step; add none:transformer to --engines")
    rows = []
    print(f"{'B':>5} {'L':>4} {'M':>6} {'engine':>11} {'model':>24} {'s/step':>9} {'peak GB':>8} "
          f"{'time x':>7} {'mem x':>7}")
    for M in args.M:
        for L in args.L:
            for B in args.B:
                cell = []
                for pair in args.engines:
                    engine, model = pair.split(":")
                    row = {"B": B, "L": L, "M": M, "engine": engine, "model": model}
                    est = estimate_gb(engine, model, B, L, M)
                    if est > args.mem_gb:
                        row["skipped"] = f"estimated {est:.1f} GB > --mem-gb {args.mem_gb:g}"
                    else:
                        cmd = [sys.executable, "-m", "benchmarks.seqrec_step", "--worker", engine, model, str(B),
                               str(L), str(M), "--repeats", str(args.repeats), "--device", args.device]
                        if args.threads:
                            cmd += ["--threads", str(args.threads)]
                        proc = subprocess.run(cmd, capture_output=True, text=True)
                        if proc.returncode:
                            row["skipped"] = "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:120]
                        else:
                            row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                    cell.append(row)
                    if "seconds" in row:
                        last = ratios(cell).iloc[-1]
                        if last["time_ratio"] == last["time_ratio"]:  # not NaN: a non-private step ran
                            row["time_ratio"] = float(last["time_ratio"])
                            row["mem_ratio"] = float(last["mem_ratio"])
                    rows.append(row)
                    if "skipped" in row:
                        print(f"{B:>5} {L:>4} {M:>6} {engine:>11} {model:>24}   skipped: {row['skipped']}")
                    else:
                        print(f"{B:>5} {L:>4} {M:>6} {engine:>11} {model:>24} {row['seconds']:>9.3f} "
                              f"{row['peak_gb']:>8.3f} {row.get('time_ratio', float('nan')):>7.2f} "
                              f"{row.get('mem_ratio', float('nan')):>7.2f}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.figure:
        try:
            print(figure(rows, Path(args.figure)))
        except ValueError as err:
            fail(f"--figure: {err}")


if __name__ == "__main__":
    main()
