"""Where a DPFormer epoch's time goes on the CPU: one cell of the task run under cProfile, with the
cumulative seconds of the functions that make a step and a validation (docs/running.md, "An epoch of
DPFormer on the CPU"; written to ``docs/dpformer_epoch_profile.json``).

    python -m benchmarks.epoch_profile --json docs/dpformer_epoch_profile.json

runs ``python -m pipeline experiment=dpformer_amazon model=dpformer seqrec.epochs=2
dataset.sample_users=6000`` (overrides after ``--``) in this process, its run in a temporary MLflow
store, and reads, from the profile, the cumulative seconds of:

* ``train``: the training loop (``pipeline.seqrec.train.run``), of which ``steps`` (the DP-SGD steps,
  ``Trainer.epoch``) and ``validation`` (the validations after each epoch);
* inside those, ``engine_forward`` (the engine's forward pass under its guard and provenance, the model's
  own forward included: ``PhantomClipping._forward``), ``reattention_variance`` (Re-Attention's propagated
  variances, ``KeyVar.quadratic``), ``item_scores`` (the tied output layer's scores, ``SeqModel.scores``)
  and ``engine_uses`` (the engine's gradient pass and layer functions: ``_uses``, ``_sq_norms`` and
  ``_bookkeeping``);
* ``provenance_python``: the provenance record's own Python time (every function of
  ``pipeline/clipping/provenance.py``, the operations it runs excluded).

cProfile slows Python-heavy code more than arithmetic: read the shares, not the seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import sys
import tempfile
from pathlib import Path

DEFAULT = ["experiment=dpformer_amazon", "model=dpformer", "seqrec.epochs=2", "dataset.sample_users=6000"]

# key: (what is read, [(file suffix, function name or None for all of the file's)]); "cumulative": the
# seconds in the functions and what they call, "own": in their own lines only; summed over the matches
FUNCTIONS = {
    "train": ("cumulative", [("pipeline/seqrec/train.py", "run")]),
    "steps": ("cumulative", [("pipeline/dpsgd/trainer.py", "epoch")]),
    "validation": ("cumulative", [("pipeline/seqrec/cell.py", "validate")]),
    "engine_forward": ("cumulative", [("pipeline/clipping/engine.py", "_forward")]),
    "reattention_variance": ("cumulative", [("pipeline/seqrec/keyvar.py", "quadratic")]),
    "item_scores": ("cumulative", [("pipeline/seqrec/models.py", "scores")]),
    "engine_uses": ("cumulative", [("pipeline/clipping/engine.py", "_uses"), ("pipeline/clipping/engine.py", "_sq_norms"),
                                   ("pipeline/clipping/engine.py", "_bookkeeping")]),
    "provenance_python": ("own", [("pipeline/clipping/provenance.py", None)]),
}


def read(stats: pstats.Stats) -> dict[str, float]:
    """The cumulative seconds of ``FUNCTIONS`` in a profile (a key whose functions never ran: refused)."""
    found = {key: 0.0 for key in FUNCTIONS}
    seen = {key: False for key in FUNCTIONS}
    for (path, _line, name), (_cc, _nc, own, cumulative, _callers) in stats.stats.items():
        path = path.replace(os.sep, "/")
        for key, (kind, wanted) in FUNCTIONS.items():
            if any(path.endswith(suffix) and fn in (None, name) for suffix, fn in wanted):
                found[key] += cumulative if kind == "cumulative" else own
                seen[key] = True
    missing = [k for k, ok in seen.items() if not ok]
    if missing:
        raise SystemExit(f"error: the profile holds no call of {missing}: the functions moved; update FUNCTIONS")
    return {k: round(v, 1) for k, v in found.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--note", default="cumulative seconds under cProfile, which slows Python-heavy code most: "
                                          "shares, not speeds")
    parser.add_argument("overrides", nargs="*", help=f"the cell's overrides (default: {' '.join(DEFAULT)})")
    a = parser.parse_args(argv)
    overrides = a.overrides or DEFAULT
    import runpy

    with tempfile.TemporaryDirectory() as tmp:
        argv0 = sys.argv
        sys.argv = ["pipeline", *overrides, f"mlflow.tracking_uri=sqlite:///{tmp}/mlflow.db", f"hydra.run.dir={tmp}/run"]
        profile = cProfile.Profile()
        try:
            profile.runcall(runpy.run_module, "pipeline", run_name="__main__", alter_sys=True)
        except SystemExit as stop:  # Hydra's main returns through sys.exit on an error
            if stop.code not in (0, None):
                raise
        finally:
            sys.argv = argv0
        seconds = read(pstats.Stats(profile))
    figures = {"command": "python -m benchmarks.epoch_profile " + " ".join(overrides),
               "cell": "python -m pipeline " + " ".join(overrides), "date": datetime.date.today().isoformat(),
               "note": a.note, "seconds": seconds}
    for key, value in seconds.items():
        print(f"{key:22s} {value:8.1f} s", flush=True)
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1) + "\n")
    return figures


if __name__ == "__main__":
    main()
