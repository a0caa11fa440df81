"""Plotting conventions both tasks share: the symbols of the results' columns, how series at the
same x are spread (``_dodged``), the audit's histogram, and ``save``, which writes every figure.
Each task draws its own figures in its ``plot`` module (``pipeline/noisyhead/plot.py``,
``pipeline/seqrec/plot.py``).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

# Axis and legend names of the results columns (math, as the paper writes them).
SYMBOLS = {"N": "$N$", "T": "$T$", "eps": r"$\varepsilon$", "delta": r"$\delta$", "attack_c": "$c$",
           "attack_p": "$p$", "attack_alpha": r"$\alpha$", "L": "$L$", "D": "$D$", "B": "$B$"}
DODGE = 0.25  # the total horizontal spread of the series at one x, as a fraction of the smallest x gap


def symbol(column: str) -> str:
    return SYMBOLS.get(column, column.replace("_", " "))


def _dodged(x: pd.Series, index: int, count: int, xs: np.ndarray, log: bool) -> np.ndarray:
    """x shifted for series ``index`` of ``count`` so that bars at the same x do not overlap."""
    x = x.to_numpy(dtype=float)
    if count < 2:
        return x
    xs = np.unique(xs.astype(float))
    if log and (xs > 0).all():
        gap = np.diff(np.log10(xs)).min() if len(xs) > 1 else 0.2
        return x * 10 ** ((index - (count - 1) / 2) * DODGE * gap / (count - 1))
    gap = np.diff(xs).min() if len(xs) > 1 else max(abs(xs[0]) * 0.2, 1.0)
    return x + (index - (count - 1) / 2) * DODGE * gap / (count - 1)


def audit_histogram(s_canary: np.ndarray, s_neighbour: np.ndarray, bound, row: dict, path: Path) -> Path:
    """The audit's statistic on the held-out runs of both neighbouring sets, with the chosen threshold."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    lo, hi = np.quantile(np.concatenate([s_canary, s_neighbour]), [0.0005, 0.9995])
    bins = np.linspace(min(lo, bound.threshold), max(hi, bound.threshold), 120)
    ax.hist(s_canary, bins=bins, alpha=0.5, label="canary set D", color="tab:red")
    ax.hist(s_neighbour, bins=bins, alpha=0.5, label="neighbouring set D'", color="tab:blue")
    ax.axvline(bound.threshold, color="black", ls="--",
               label=f"threshold ({bound.region}; TPR {bound.tpr:.3g}, FPR {bound.fpr:.3g})")
    ax.set_yscale("log")
    ax.set_xlabel("statistic <output, mean difference>")
    ax.set_ylabel("runs")
    ax.set_title(f"{row['method']}: eps >= {bound.eps_lower:.3g} (claimed {row['eps']:g}, delta {row['delta']:g}): "
                 f"{row['verdict']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, path)


def save(fig, path: Path, dpi: int = 130) -> Path:
    """Write ``fig`` as a PNG (its folder created) and close it: every figure of both tasks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
