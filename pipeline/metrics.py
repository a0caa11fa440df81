"""``python -m pipeline.metrics [stage ...]``: each DVC stage's ``metrics.json`` as a short table a
person can read, in place of ``dvc metrics show``'s one row of about 150 columns (which prints
Figure 1's headline 7.5e-7 as 0.0).

Three shapes of key are folded into tables, numbers in 4 significant digits:

- ``<model>.eps_<e>.<metric>`` (the DPFormer and language-model stages) and the distraction
  stage's ``<errors>.eps<e>.<variant>.<metric>``: one row per model, one column per eps;
- ``<method>_<measure>_mean_min`` / ``_max`` (NoisyHead's stages): one row per method and measure,
  "min .. max" of the cells' means;
- anything else (``cells``, ``trials``): ``key  value`` lines.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BY_EPS = re.compile(r"^(?P<row>.+)\.eps_(?P<eps>[^.]+)\.(?P<metric>[^.]+)$")
_BY_EPS_INSIDE = re.compile(r"^(?P<a>[^.]+)\.eps(?P<eps>[0-9.]+|inf)\.(?P<b>[^.]+)\.(?P<metric>[^.]+)$")  # distraction
_RANGE = re.compile(r"^(?P<row>.+)_mean_(?P<end>min|max)$")


def _g(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _eps_order(eps: str) -> tuple:
    try:
        return (0, float(eps))
    except ValueError:
        return (1, eps)


def tables(metrics: dict) -> str:
    """The readable form of one stage's metrics."""
    by_eps: dict[str, dict[str, dict[str, object]]] = {}
    ranges: dict[str, dict[str, object]] = {}
    rest = []
    for key, value in metrics.items():
        if m := _BY_EPS.match(key):
            by_eps.setdefault(m["metric"], {}).setdefault(m["row"], {})[m["eps"]] = value
        elif m := _BY_EPS_INSIDE.match(key):
            by_eps.setdefault(m["metric"], {}).setdefault(f"{m['a']} {m['b']}", {})[m["eps"]] = value
        elif m := _RANGE.match(key):
            ranges.setdefault(m["row"], {})[m["end"]] = value
        else:
            rest.append((key, value))
    width = max((len(k) for k, _ in rest), default=0)
    out = [f"{key:<{width}}  {_g(value)}" for key, value in rest]
    for metric, rows in by_eps.items():
        eps = sorted({e for cells in rows.values() for e in cells}, key=_eps_order)
        width = max(len(r) for r in rows)
        out.append(f"{metric:<{width}}  " + "  ".join(f"{'eps=' + e:>10}" for e in eps))
        for row, cells in rows.items():
            out.append(f"{row:<{width}}  " + "  ".join(f"{_g(cells[e]) if e in cells else '':>10}" for e in eps))
    if ranges:
        head = "the cells' means over trials"
        width = max(len(head), *(len(r) for r in ranges))
        out.append(f"{head:<{width}}  {'min':>10}  {'max':>10}")
        for row, ends in sorted(ranges.items()):
            out.append(f"{row:<{width}}  {_g(ends.get('min', '')):>10}  {_g(ends.get('max', '')):>10}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stages", nargs="*", help="stage names (artifacts/<stage>/); none: every stage")
    args = parser.parse_args(argv)
    found = sorted((ROOT / "artifacts").glob("*/metrics.json"))
    if args.stages:
        known = {p.parent.name: p for p in found}
        missing = [s for s in args.stages if s not in known]
        if missing:
            print(f"error: no artifacts/<stage>/metrics.json for {missing}; stages with one: {sorted(known)}", file=sys.stderr)
            return 2
        found = [known[s] for s in args.stages]
    for path in found:
        print(f"== {path.parent.name}\n{tables(json.loads(path.read_text()))}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
