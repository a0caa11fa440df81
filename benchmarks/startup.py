"""How long the command line takes to answer, beside a bare ``python -c pass``.

    python -m benchmarks.startup               # each command 5 times, the median and the range
    python -m benchmarks.startup --repeats 9

Each command runs as a user would run it, in a fresh child process from the repository root, into a
scratch folder and MLflow store: ``--help``; three refusals (a bad key, a bad value, a bad data path),
which must answer before any folder or run is made; and one small cell (``trials=100``: NoisyHead's
ridge, GD and NoisyHead on Figure 1's first cell, its table, figure and MLflow run), each time into a
new store (a user's first run pays for creating it; the cell run again into the same store shows what
later runs pay). Printed: wall seconds of each (median, min, max), and for the cell where its time
went, read off one ``-X importtime`` run (torch, MLflow, the privacy accountant, plotting).
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
    print(f"\n{'DP-SGD calibration of a cell':34} {'first':>9} {'repeated':>9}  (s, median of {args.repeats})")
    for name, (first, again) in calibration(args.repeats).items():
        print(f"{name:34} {first:9.3f} {again:9.6f}", flush=True)


if __name__ == "__main__":
    main()
