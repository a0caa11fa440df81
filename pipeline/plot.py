"""Plotting conventions both tasks share: the symbols of the results' columns, how series at the
same x are spread (``dodged``), one colour per method or model (``color``), the audit's histogram, and ``save``, which writes every figure.
Each task draws its own figures in its ``plot`` module (``pipeline/noisyhead/plot.py``,
``pipeline/seqrec/plot.py``).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

# Axis and legend names of the results columns (math, as the paper writes them).
SYMBOLS = {"N": "$N$", "T": "$T$", "eps": r"$\varepsilon$", "delta": r"$\delta$", "attack_c": "$c$",
           "attack_p": "$p$", "attack_alpha": r"$\alpha$", "L": "$L$", "D": "$D$", "B": "$B$"}
DODGE = 0.25  # the total horizontal spread of the series at one x, as a fraction of the smallest x gap


def symbol(column: str) -> str:
    return SYMBOLS.get(column, column.replace("_", " "))


# One colour per method or model, the same in every figure of both tasks (tab10, then tab20's
# lighter shades; a name not listed gets a fixed colour from its name).
COLORS = {
    # NoisyHead's estimators (conf/noisyhead/method/)
    "ridge": "#7f7f7f", "gd": "#ff7f0e", "noisyhead": "#1f77b4", "noisyhead_tight": "#17becf",
    "dp_ridge": "#2ca02c", "dp_ridge_paper": "#98df8a", "ssp": "#9467bd", "dpsgd": "#d62728", "zero": "#000000",
    # DPFormer's models (conf/seqrec/model/) and baselines
    "transformer": "#ff7f0e", "dpformer": "#1f77b4", "dpformer:presence-public": "#aec7e8",
    "dpformer:form-off": "#c5b0d5", "dpformer:form-paper": "#9467bd", "transformer_untied": "#8c564b",
    "transformer_untied_half": "#c49c94", "gru": "#2ca02c", "lstm": "#e377c2", "popular": "#7f7f7f",
    "oracle": "#000000",
}
_SPARE = ["#bcbd22", "#dbdb8d", "#ffbb78", "#ff9896", "#f7b6d2", "#9edae5", "#c7c7c7", "#8c6d31"]


def color(name: str) -> str:
    """The colour of a method or model (``transformer (non-private)`` is drawn as ``transformer``,
    dashed where it matters, by the caller)."""
    import zlib

    base = str(name).split(" (")[0]
    if base in COLORS:
        return COLORS[base]
    return _SPARE[zlib.crc32(base.encode()) % len(_SPARE)]


def dodged(x: np.ndarray, index: np.ndarray, count: np.ndarray, xs: np.ndarray, log: bool) -> np.ndarray:
    """Each point x shifted for its series' position ``index`` among the ``count`` series that have a
    point at that same x (in the same panel), so that their error bars do not overlap; a point
    alone at its x stays exactly where it is. ``xs``: every x of the panel (the spacing)."""
    x = np.asarray(x, dtype=float)
    index, count = np.asarray(index, dtype=float), np.asarray(count, dtype=float)
    offset = np.where(count > 1, (index - (count - 1) / 2) / np.maximum(count - 1, 1), 0.0) * DODGE
    xs = np.unique(np.asarray(xs, dtype=float))
    if log and (xs > 0).all():
        gap = np.diff(np.log10(xs)).min() if len(xs) > 1 else 0.2
        return x * 10 ** (offset * gap)
    gap = np.diff(xs).min() if len(xs) > 1 else max(abs(xs[0]) * 0.2, 1.0)
    return x + offset * gap


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
