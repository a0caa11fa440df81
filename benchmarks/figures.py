"""Speed and memory of the paper's figures, and the batched pipeline against a per-trial loop.

    python -m benchmarks.figures                  # Figures 1-4 at B = 500, then the side-by-side cell
    python -m benchmarks.figures --device cuda    # the same on a GPU (compute.device=cuda)
    python -m benchmarks.figures --only cell
    python -m benchmarks.figures --only loop      # Figure 1 at B = 100 against the per-trial NumPy loop

Each figure runs as a user would run it (``python -m pipeline experiment=... -m``, MLflow
and plots included) in a child process on ``--device`` (``compute.device``), into a scratch
MLflow store; printed: the wall time (process start, imports and MLflow included), the sum of
its cells' own seconds (``metrics.cell.seconds``: the compute) and the rest per cell (the
sweep's overhead: process start, composition, validation, MLflow writes, figures), the child's peak
resident memory, and on a GPU the largest peak device memory of its cells (``compute.peak_memory_gb``).
The side-by-side part times one Figure-1 cell (N = 1000, eps = 0.2, B = 500) in this process:
the pipeline's data, fit and evaluate steps on ``--device``, then
``benchmarks/baseline_numpy.py``'s plain per-trial loop of the same protocol (NumPy, CPU). The
loop part runs Figure 1 at B = 100 (35 cells) as a user would, start-up, validation, MLflow and
figures included, against that loop over the same 35 cells, and prints the ratio and the sweep's
validation time per cell (its log's "checked n cells in s").
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("fig1_lowdim", "fig2_highdim", "fig3_overparam", "fig4_robustness")


def run_figure(name: str, scratch: Path, device: str, extra: list[str] = ()) -> tuple[float, float, int, float, float | None]:
    """Wall seconds, the cells' summed seconds, the number of cells, peak RSS (GB) and peak device
    memory (GiB; None on the CPU) of one figure's sweep, run as a child process (``extra``: more
    overrides, e.g. ``trials=2`` for a dry run)."""
    store = f"sqlite:///{scratch / name / 'mlflow.db'}"
    cmd = [sys.executable, "-m", "pipeline", f"experiment={name}", f"compute.device={device}",
           f"mlflow.tracking_uri={store}", f"hydra.sweep.dir={scratch / name}", *extra, "-m"]
    start = time.perf_counter()
    with open(scratch / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{name} failed; see {scratch / f'{name}.log'}")
    import mlflow

    mlflow.set_tracking_uri(store)
    cells = mlflow.search_runs(search_all_experiments=True, filter_string="tags.kind = 'cell'")
    compute = float(cells["metrics.cell.seconds"].sum())
    gpu = None
    if not device.startswith("cpu") and cells["params.compute.device"].str.startswith("cuda").any():
        gpu = float(cells["metrics.compute.peak_memory_gb"].max())
    return seconds, compute, len(cells), usage.ru_maxrss / 1e6, gpu  # ru_maxrss is in KiB on Linux


def side_by_side(trials: int, device_spec: str) -> None:
    import torch
    from hydra import compose, initialize_config_dir

    from benchmarks import baseline_numpy
    from pipeline import device
    from pipeline.noisyhead import config, data, evaluate
    from pipeline.noisyhead.methods import ESTIMATORS

    def cfg_for(B: int):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return compose("config", overrides=["regime=lowdim", "regime.N=1000", "privacy.eps=0.2", f"trials={B}",
                                                f"compute.device={device_spec}"])

    def batched(cfg, const) -> tuple[float, float, torch.Tensor]:
        """Seconds for the prompts, seconds for the estimators and evaluation, NoisyHead's excess risks."""
        start = time.perf_counter()
        problem = data.make_problem(cfg, const, dev)
        device.synchronize(dev)
        prompts = time.perf_counter() - start
        fits = {name: ESTIMATORS[spec.estimator].fit(problem, const, cfg, spec) for name, spec in cfg.method.items()}
        excess = [evaluate.gap(fits[m].gamma, fits["ridge"].gamma, problem.test, cfg.compute.chunk_trials)
                  for m in ("gd", "noisyhead")]
        device.synchronize(dev)
        return prompts, time.perf_counter() - start - prompts, excess[1][:, 0].cpu()

    def looped(cfg, const) -> tuple[float, float, torch.Tensor]:
        clock = {"prompts": 0.0}
        start = time.perf_counter()
        risks = baseline_numpy.run(const, eps=0.2, delta=cfg.privacy.delta, trials=cfg.trials,
                                   n_test=cfg.dataset.n_test, clock=clock)
        return clock["prompts"], time.perf_counter() - start - clock["prompts"], torch.from_numpy(risks[:, 1])

    dev = device.of(cfg_for(4))
    device.configure(cfg_for(4), dev)
    warm = cfg_for(4)  # first calls (thread pools, kernels, allocator) are paid before the clock starts
    for run in (batched, looped):
        run(warm, config.validate(warm))
    cfg = cfg_for(trials)
    const = config.validate(cfg)
    rows = {"batched pipeline": batched(cfg, const), "per-trial NumPy": looped(cfg, const)}
    print(f"\nOne Figure-1 cell (N = 1000, eps = 0.2, B = {trials}, torch threads = {torch.get_num_threads()}, "
          f"pipeline on {dev}: {device.name(dev)}), both warmed up on 4 trials first:")
    print(f"  {'':18} {'total':>8} {'prompts':>9} {'estimators':>11} {'trials/s':>9}")
    for name, (prompts, rest, _) in rows.items():
        print(f"  {name:18} {prompts + rest:7.2f}s {prompts:8.2f}s {rest:10.2f}s {trials / (prompts + rest):9.1f}")
    (p1, r1, nh), (p2, r2, nh_loop) = rows.values()
    print(f"  {'speed ratio':18} {(p2 + r2) / (p1 + r1):7.1f}x {p2 / p1:8.1f}x {r2 / r1:10.1f}x")
    print("  (prompts: drawing the training and test prompts and building their features;"
          " estimators: ridge, GD, NoisyHead and the evaluation)")
    se = (nh.var() / trials + nh_loop.var() / trials).sqrt().item()
    print(f"  NoisyHead excess risk: batched {nh.mean():.4f}, loop {nh_loop.mean():.4f} (difference {nh.mean() - nh_loop.mean():+.4f}, "
          f"{abs(nh.mean() - nh_loop.mean()).item() / se:.1f} standard errors)")


def figure_against_loop(trials: int, device_spec: str) -> None:
    """Figure 1 at B = ``trials`` run as a user runs it, then ``baseline_numpy``'s per-trial loop of
    the authors' protocol over the same cells (NumPy, CPU; the prompts drawn and the estimators
    fitted trial by trial), and the ratio of their wall times."""
    from hydra import compose, initialize_config_dir

    from benchmarks import baseline_numpy
    from pipeline.noisyhead import config

    name = "fig1_lowdim"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).mkdir()
        seconds, compute, n, _, _ = run_figure(name, Path(tmp), device_spec, [f"trials={trials}"])
        checked = re.search(r"checked (\d+) cells in ([0-9.]+) s: the first in ([0-9.]+) s.*?the others in ([0-9.]+) ms",
                            (Path(tmp) / f"{name}.log").read_text())
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        grid = compose("config", overrides=[f"experiment={name}"], return_hydra_config=True).hydra.sweeper.params
        cells = [(int(N), float(eps)) for N in str(grid["regime.N"]).split(",") for eps in str(grid["privacy.eps"]).split(",")]
        loop = 0.0
        for N, eps in cells:
            cfg = compose("config", overrides=[f"experiment={name}", f"regime.N={N}", f"privacy.eps={eps}", f"trials={trials}"])
            const = config.validate(cfg)
            start = time.perf_counter()
            baseline_numpy.run(const, eps=eps, delta=cfg.privacy.delta, trials=trials, n_test=cfg.dataset.n_test)
            loop += time.perf_counter() - start
    print(f"\nFigure 1 at B = {trials} ({n} cells): the pipeline {seconds:.1f} s (process start, validation, MLflow and"
          f" figures included; the cells' own compute {compute:.1f} s), the per-trial NumPy loop {loop:.1f} s over the"
          f" same {len(cells)} cells: {loop / seconds:.1f}x")
    if checked:
        print(f"  validation: {checked[1]} cells checked in {float(checked[2]):.2f} s, the first in {float(checked[3]):.2f} s"
              f" (the imports and store it opens), the others in {float(checked[4]):.1f} ms a cell")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("figures", "cell", "loop"), help="run only one part")
    parser.add_argument("--trials", type=int, default=500, help="B of the side-by-side cell")
    parser.add_argument("--device", default="auto", help="compute.device: auto, cpu, cuda or cuda:N (default auto)")
    parser.add_argument("--overrides", nargs="*", default=[], help="more overrides for every figure (a dry run: trials=2)")
    args = parser.parse_args()
    from pipeline import device
    from pipeline.validation import ConfigError

    try:
        dev = device.resolve(args.device)
    except ConfigError as err:
        raise SystemExit(f"error: --device: {err}")
    print(f"device: {dev} ({device.name(dev)})")
    if args.only in (None, "figures"):
        totals = [0.0, 0.0, 0]
        with tempfile.TemporaryDirectory() as tmp:
            print(f"{'figure':<16} {'wall time':>10} {'cells':>9} {'n':>4} {'overhead/cell':>14} {'peak RSS':>10} "
                  f"{'peak GPU memory':>16}")
            for name in FIGURES:
                (Path(tmp) / name).mkdir()
                seconds, compute, n, peak, gpu = run_figure(name, Path(tmp), str(dev), args.overrides)
                totals[0] += seconds
                totals[1] += compute
                totals[2] += n
                shown = f"{gpu:>12.2f} GiB" if gpu is not None else f"{'-':>16}"
                print(f"{name:<16} {seconds:>9.1f}s {compute:>8.1f}s {n:>4} {(seconds - compute) / n:>13.2f}s "
                      f"{peak:>7.2f} GB {shown}", flush=True)
        print(f"{'total':<16} {totals[0]:>9.1f}s {totals[1]:>8.1f}s {totals[2]:>4} "
              f"{(totals[0] - totals[1]) / totals[2]:>13.2f}s")
        print("(cells: the cells' own seconds, metrics.cell.seconds; overhead/cell: the rest of the wall time,"
              " process start, composition, validation, MLflow and figures included, per cell)")
    if args.only in (None, "cell"):
        side_by_side(args.trials, str(dev))
    if args.only in (None, "loop"):
        figure_against_loop(100, str(dev))


if __name__ == "__main__":
    main()
