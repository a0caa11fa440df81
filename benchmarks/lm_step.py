"""Experiment 3 of the language-model task (issue 38): the cost of exact per-post clipping against
the vocabulary size, time and peak memory of one DP-SGD step with each of the task's engines, on the
task's own model (Hugging Face GPT-2 built from a config, ``pipeline.lm.models``), its per-post loss
(``pipeline.lm.examples.example_losses``) and its engines (``pipeline.lm.engines``), against the
non-private step of the same model (tied or untied) at the same V.

    python -m benchmarks.lm_step                                   # V = 8k, 32k, 50k on the CPU
    python -m benchmarks.lm_step --V 8000 --B 8 --json out.json --figure out.png
    python -m benchmarks.lm_step --device cuda --B 64 --L 256      # the same on a GPU

Engines (``engine:tying``): ``none`` (one backward of the summed loss), ``phantom`` (the shared
engine: the tied table's norm with its cross term, by book-keeping), ``per_sample`` (Opacus's hooks,
every post's gradient instantiated: B x V x d floats for the table) and ``ghost`` (Opacus's ghost
clipping, untied only: it refuses the tie). Each cell runs in a fresh process (so that one engine's
peak does not hide the next's); its time is the median over ``--repeats`` steps after one warm-up;
its peak memory is the GPU's peak allocated memory on CUDA, and on the CPU the step's growth of the
resident set over the process's size before it (``ru_maxrss``; the model and batch are made first).
A batch is B posts of L + 1 random token ids, every target real (the cost does not depend on the ids).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

from benchmarks.measure import measure

ROOT = Path(__file__).resolve().parents[1]
warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus's hooks on id-fed layers
CELLS = ("none:tied", "phantom:tied", "per_sample:tied", "none:untied", "phantom:untied", "ghost:untied")
LABELS = {"phantom:tied": "Phantom (tied)", "per_sample:tied": "Opacus per-sample (tied)",
          "phantom:untied": "Phantom (untied)", "ghost:untied": "Opacus ghost (untied)"}


def cell(name: str, V: int, B: int, L: int, d: int, layers: int, heads: int, repeats: int, device: str) -> dict:
    """One engine and tying at one V, in this process: median seconds per step and peak memory (GiB)."""
    import torch

    from pipeline.lm import engines, models

    engine, tying = name.split(":")
    torch.manual_seed(0)
    dev = torch.device(device)
    model = models.build(vocab_size=V, max_len=L, d=d, layers=layers, heads=heads, tied=tying == "tied",
                         dropout=0.0).to(dev)
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, V, (B, L + 1), generator=gen).to(dev), torch.ones(B, L, dtype=torch.bool, device=dev))
    clip = engines.make(engine, model, 1.0)

    seconds, peak = measure(lambda: clip.step(batch), dev, repeats)
    return {"cell": name, "engine": engine, "tying": tying, "V": V, "B": B, "L": L, "d": d, "layers": layers,
            "seconds": seconds, "peak_gib": peak, "device": device,
            "threads": torch.get_num_threads(), "parameters": models.parameters(model)}


def figure(rows: list[dict], path: Path) -> None:
    """Time and peak memory of each private engine over its non-private step, against V (as
    DPFormer's Figure 3): one line per engine and tying."""
    import matplotlib.pyplot as plt

    from pipeline import plot  # the Agg backend, and save
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    done = [r for r in rows if "error" not in r and r["engine"] != "none"]
    for key, ax, label in (("time_ratio", axes[0], "time per step / non-private"),
                           ("memory_ratio", axes[1], "peak memory / non-private")):
        for name, shown in LABELS.items():
            pts = sorted((r["V"], r[key]) for r in done if r["cell"] == name and r.get(key) is not None)
            if pts:
                ax.plot([v for v, _ in pts], [y for _, y in pts], marker="o", label=shown)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(xscale="log", xlabel="vocabulary size V", ylabel=label)
        ax.set_ylim(bottom=0)
    first = done[0] if done else {}
    fig.suptitle(f"One DP-SGD step of GPT-2 (d = {first.get('d')}, {first.get('layers')} layers, B = {first.get('B')}, "
                 f"L = {first.get('L')}, {first.get('device')}, {first.get('threads')} thread(s))", fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    plot.save(fig, path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--V", type=int, nargs="+", default=[8000, 32000, 50000])
    parser.add_argument("--B", type=int, default=16, help="posts per step")
    parser.add_argument("--L", type=int, default=128, help="tokens per post (the CPU preset's)")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads in each cell (default: torch's)")
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=CELLS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--figure", type=Path, help="draw the ratios against V here")
    parser.add_argument("--cell", nargs=2, metavar=("CELL", "V"), help=argparse.SUPPRESS)  # a child's one cell
    args = parser.parse_args(argv)
    shape = ["--B", str(args.B), "--L", str(args.L), "--d", str(args.d), "--layers", str(args.layers),
             "--heads", str(args.heads), "--repeats", str(args.repeats), "--device", args.device]
    if args.cell:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(cell(args.cell[0], int(args.cell[1]), args.B, args.L, args.d, args.layers, args.heads,
                              args.repeats, args.device)))
        return []
    rows = []
    print(f"{'V':>6} {'engine:tying':<18} {'s/step':>8} {'x time':>7} {'peak GiB':>9} {'x memory':>9}", flush=True)
    for V in args.V:
        base = {}
        for name in args.cells:
            cmd = [sys.executable, "-m", "benchmarks.lm_step", "--cell", name, str(V), *shape]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
            if proc.returncode != 0:
                reason = (proc.stderr.strip().splitlines() or ["failed"])[-1][:100]
                print(f"{V:>6} {name:<18} failed: {reason}", flush=True)
                rows.append({"cell": name, "V": V, "error": reason})
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            ref = base.setdefault(row["tying"], row) if row["engine"] == "none" else base.get(row["tying"])
            row["time_ratio"] = row["seconds"] / ref["seconds"] if ref else None
            row["memory_ratio"] = row["peak_gib"] / ref["peak_gib"] if ref and ref["peak_gib"] > 0 else None
            rows.append(row)
            shown = [f"{r:>6.2f}x" if r is not None else f"{'-':>7}" for r in (row["time_ratio"], row["memory_ratio"])]
            print(f"{V:>6} {name:<18} {row['seconds']:>8.3f} {shown[0]} {row['peak_gib']:>9.3f} {shown[1]:>9}",
                  flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    if args.figure:
        figure(rows, args.figure)
    return rows


if __name__ == "__main__":
    main()
