"""How long the command line takes to answer, beside a bare ``python -c pass``.

    python -m benchmarks.startup               # each command 5 times, the median and the range
    python -m benchmarks.startup --repeats 9

Each command runs as a user would run it, in a fresh child process from the repository root, into a
scratch folder and MLflow store: ``--help``; three refusals (a bad key, a bad value, a bad data path),
which must answer before any folder or run is made; and one small cell (``trials=100``: NoisyHead's
ridge, GD and NoisyHead on Figure 1's first cell, its table, figure and MLflow run), each time into a
new store (a user's first run pays for creating it; the cell run again into the same store shows what
later runs pay). Printed: wall seconds of each (median, min, max), and for the cell where its time
went, read off one ``-X importtime`` run (torch, MLflow, the privacy accountant, plotting), and the
cell's floor: one fresh process doing only what the cell cannot skip (``FLOOR``: torch, one Hydra
composition, the spent eps, an MLflow run in an existing store, a saved figure), each step timed, with
Python's default garbage collector and with it off and the heap frozen at exit (what
``pipeline/collector.py`` does for a single run).
The targets (issue 36): the three refusals and ``--help`` at most 1 s, the cell at most 5 s, on an
idle two-core machine.

Then, in this process, DP-SGD's calibration (``pipeline.privacy``'s cached accountant calls) for the
plan of a DPFormer cell (``seqrec.train.plan``: noise multiplier and spent eps) at the CI preset and at
the CPU presets' Figure 2: the first call (the cache cleared, Opacus's bisection paid) against a repeat
(what a cell pays after its sweep's validation calibrated it in the same process, and what a tuning
grid's cells that differ in a learning rate only pay there: the default launcher runs a sweep's cells in
its own process; joblib's workers each fill a cache of their own).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands(scratch: Path) -> dict[str, list[str]]:
    """name -> the arguments after ``python``; a new ``{n}`` folder per repeat where it writes."""
    store = f"mlflow.tracking_uri=sqlite:///{scratch}/{{n}}/mlflow.db"
    out = f"hydra.run.dir={scratch}/{{n}}/run"
    pipeline = ["-m", "pipeline", store, out]
    return {
        "python -c pass": ["-c", "pass"],
        "--help": ["-m", "pipeline", "--help"],
        "refused key (privacy.epss=1)": [*pipeline, "privacy.epss=1"],
        "refused value (privacy.eps=abc)": [*pipeline, "privacy.eps=abc"],
        "refused path (dataset.archive)": [*pipeline, "dataset=newsgroups", "dataset.archive=/no/such/20news.tar.gz"],
        "cell trials=100, new store": [*pipeline, "trials=100"],
        "cell trials=100, same store": ["-m", "pipeline", f"mlflow.tracking_uri=sqlite:///{scratch}/same.db",
                                        f"hydra.run.dir={scratch}/same/{{n}}", "trials=100"],
    }


def once(args: list[str], n: int) -> tuple[float, int]:
    args = [a.replace("{n}", str(n)) for a in args]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - start, proc.returncode


def import_shares(scratch: Path) -> dict[str, float]:
    """Seconds the cell spends importing the heavy packages (cumulative, as ``-X importtime`` reports
    them at their first import), from one run."""
    args = ["-X", "importtime", "-m", "pipeline", f"mlflow.tracking_uri=sqlite:///{scratch}/imp.db",
            f"hydra.run.dir={scratch}/imp", "trials=100"]
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the -X importtime run failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    wanted = ("torch", "mlflow", "dp_accounting", "matplotlib", "seaborn", "pandas", "hydra", "sqlalchemy", "scipy")
    found: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        _, cumulative, name = (part.strip() for part in line[len("import time:"):].split("|"))
        if name in wanted and name not in found:
            found[name] = int(cumulative) / 1e6
    return found


# What one cell cannot do without, each step in one fresh process, in this order (later steps reuse what
# earlier ones imported, as the cell does): torch (its algebra), Hydra's composition of the cell's config,
# the spent eps (dp-accounting's inversion, which imports SciPy), an MLflow run in an existing SQL store
# with one artifact, and a two-panel figure saved as the cells' figures are (Agg, 130 dpi). None of the
# project's own code runs but the accountant's call. Twice: with Python's default garbage collector, and
# with the collector off (``frozen``: the imports make long-lived objects only, and each automatic
# collection traverses all of them) and the heap frozen at exit (the interpreter's final collections skip
# it). The second is a floor for any implementation on these libraries, whatever it defers or caches.
FLOOR = """
import atexit, gc, json, sys, time
if sys.argv[5] == "frozen":
    gc.disable()
    atexit.register(gc.freeze)  # registered first: runs last
t = [time.perf_counter()]
steps = {}
def mark(name):
    t.append(time.perf_counter()); steps[name] = t[-1] - t[-2]
import torch
torch.ones(3, 3, dtype=torch.float64) @ torch.ones(3, 3, dtype=torch.float64)
mark("torch")
from hydra import compose, initialize_config_dir
with initialize_config_dir(sys.argv[1], version_base="1.3"):
    compose("config", overrides=["trials=100"])
mark("hydra compose")
from pipeline.privacy import spent_epsilon
spent_epsilon(multiplier=2.0, T=100, delta=1e-5)
mark("spent eps")
import mlflow
mlflow.set_tracking_uri(sys.argv[2])
mlflow.set_experiment("floor")
with mlflow.start_run():
    mlflow.log_param("trials", 100)
    mlflow.log_metric("excess_risk", 0.5)
    mlflow.log_artifact(sys.argv[3])
mark("MLflow run")
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.0))
for ax in axes:
    for k in range(3):
        ax.errorbar([1e3, 2e3, 4e3], [k + 1.0, k + 0.5, k + 0.2], yerr=0.1, marker="o", label=str(k))
    ax.set_xscale("log"); ax.set_yscale("log"); ax.legend()
fig.tight_layout()
fig.savefig(sys.argv[4], dpi=130)
mark("figure")
print(json.dumps(steps))
"""
COLLECTORS = ("default", "frozen")


def floor(scratch: Path, repeats: int, collector: str = "frozen", warm: bool = True
          ) -> tuple[dict[str, float], list[float]]:
    """The median seconds of each FLOOR step and the wall seconds of each whole process (``collector``:
    one of COLLECTORS), into the store ``scratch/floor.db`` (made by a first, uncounted process when
    ``warm``: the cell's floor opens an existing store) and the figure ``scratch/floor.png``."""
    store = f"sqlite:///{scratch}/floor.db"
    artifact = scratch / "floor.txt"
    artifact.write_text("results\n")
    args = ["-c", FLOOR, str(ROOT / "conf"), store, str(artifact), str(scratch / "floor.png"), collector]
    if warm:
        subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, check=True)  # the store, the caches
    steps, walls = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
        if proc.returncode != 0:
            raise RuntimeError(f"the floor's process failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        steps.append(json.loads(proc.stdout.splitlines()[-1]))
    return {k: statistics.median(s[k] for s in steps) for k in steps[0]}, walls


CALIBRATED = {  # name -> overrides of a DPFormer cell whose plan is calibrated; n_users from its dataset
    "dpformer_ci": ["experiment=dpformer_ci"],
    "dpformer_fig2 (eps 5)": ["experiment=dpformer_fig2", "model=dpformer", "seqrec.batch_size=128"],
}


def calibration(repeats: int) -> dict[str, tuple[float, float]]:
    """name -> (seconds of a first plan, median seconds of a repeated plan), in this process, after a
    plan at other settings has paid for the imports."""
    from hydra import compose, initialize_config_dir

    from pipeline import privacy
    from pipeline.seqrec import train

    out = {}
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        configs = {name: compose("config", overrides=overrides) for name, overrides in CALIBRATED.items()}
        warm = configs["dpformer_ci"]
        train.plan(warm, int(warm.dataset.n_users) + 1)  # the imports (Opacus's accountants), not counted
        for name, cfg in configs.items():
            n_users = int(cfg.dataset.n_users)
            first = []
            for _ in range(repeats):
                privacy._noise_multiplier.cache_clear()
                privacy._spent_epsilon.cache_clear()
                start = time.perf_counter()
                train.plan(cfg, n_users)
                first.append(time.perf_counter() - start)
            again = []
            for _ in range(repeats):
                start = time.perf_counter()
                train.plan(cfg, n_users)
                again.append(time.perf_counter() - start)
            out[name] = (statistics.median(first), statistics.median(again))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        scratch = Path(tmp)
        print(f"{'command':34} {'median':>7} {'min':>7} {'max':>7}  exit")
        for name, cmd in commands(scratch).items():
            once(cmd, -1)  # warm the file cache and byte-code; not counted
            runs = [once(cmd, n) for n in range(args.repeats)]
            seconds = [s for s, _ in runs]
            codes = sorted({c for _, c in runs})
            print(f"{name:34} {statistics.median(seconds):7.2f} {min(seconds):7.2f} {max(seconds):7.2f}  "
                  f"{','.join(map(str, codes))}", flush=True)
        shares = import_shares(scratch)
        print("the cell's imports (s, cumulative at first import): "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])))
        for collector in COLLECTORS:
            steps, walls = floor(scratch, args.repeats, collector)
            print(f"{'floor, collector ' + collector:34} {statistics.median(walls):7.2f} {min(walls):7.2f} "
                  f"{max(walls):7.2f}  (" + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()) + ")", flush=True)
    print(f"\n{'DP-SGD calibration of a cell':34} {'first':>9} {'repeated':>9}  (s, median of {args.repeats})")
    for name, (first, again) in calibration(args.repeats).items():
        print(f"{name:34} {first:9.3f} {again:9.6f}", flush=True)


if __name__ == "__main__":
    main()
