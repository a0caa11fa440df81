"""The plot step of next-item runs: a cell's training curves, and a sweep's test metrics."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from matplotlib.ticker import MaxNLocator  # noqa: E402

from pipeline.plot import COLORS, color, save  # noqa: E402
from pipeline.seqrec.evaluate import BASELINES  # noqa: E402

# Re-Attention's ablation variants (conf/seqrec/experiment/dpformer_ablation.yaml), each a colour of
# its own beside pipeline/plot.COLORS (which holds the models and the one-setting variants). The name
# hash that colours any other name gave two of them one colour; these, and the pool that other
# variants (``dpformer:blocks-1``, ...) are hashed into, are tab20b and tab20c shades that neither
# pipeline/plot.COLORS nor its spare colours use. A variant correcting block 2 only takes the
# lightest shade of its every-block counterpart's family.
VARIANT_COLORS = {
    "dpformer:presence-public:form-off": "#e6550d",   # the ablation's reference: no correction
    "dpformer:form-off:errors-adam": "#843c39",       # its controls (the same training)
    "dpformer:presence-public:form-off:blocks-2": "#fdae6b",
    "dpformer:form-off:errors-adam:blocks-2": "#e7969c",
    "dpformer:presence-public:form-paper": "#7b4173",
    "dpformer:presence-public:form-paper:blocks-2": "#de9ed6",
    "dpformer:errors-adam": "#637939",
    "dpformer:errors-adam:blocks-2": "#cedb9c",
    "dpformer:form-paper:errors-adam": "#393b79",
    "dpformer:form-paper:errors-adam:blocks-2": "#9c9ede",
    "dpformer:presence-public:blocks-2": "#6baed6",   # beside pipeline/plot.COLORS' dpformer:presence-public
}
VARIANT_POOL = ["#5254a3", "#8ca252", "#bd9e39", "#ad494a", "#a55194", "#6b6ecf", "#b5cf6b", "#e7ba52", "#d6616b", "#ce6dbd"]


def model_color(name: str) -> str:
    """A model's colour in every DPFormer figure: pipeline.plot's for the models and baselines, an
    ablation variant's own, and for any other variant (a name with a colon) a fixed one from its name."""
    import zlib

    base = str(name).split(" (")[0]
    if base in VARIANT_COLORS:
        return VARIANT_COLORS[base]
    if ":" in base and base not in COLORS:
        return VARIANT_POOL[zlib.crc32(base.encode()) % len(VARIANT_POOL)]
    return color(name)


def curves(history, path: Path, title: str = "", k: int = 10) -> Path:
    """Training loss per epoch, and validation NDCG@k / HIT@k at the evaluated epochs."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(history.epoch, history.loss, marker="o", ms=3)
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("training loss (mean cross-entropy per user)")
    ax1.grid(alpha=0.3)
    if history.valid:
        ep = [v["epoch"] for v in history.valid]
        for key, metric in ((f"ndcg{k}", f"NDCG@{k}"), (f"hit{k}", f"HIT@{k}")):
            ax2.plot(ep, [v[key] for v in history.valid], marker="o", ms=3, label=metric)
        ax2.legend(fontsize=8)
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("validation metric (%)")
    ax2.grid(alpha=0.3)
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save(fig, path, dpi=120)


def sweep_figure(results: pd.DataFrame, path: Path, k: int = 10) -> Path:
    """Test NDCG@k and HIT@k of every (model, clipping) against eps, the popularity baseline dashed."""
    test = results[results["split"] == "test"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    model_rows = test[~test["method"].isin(BASELINES)]
    eps = sorted(test["eps"].unique())  # one tick per eps (inf, non-private, last)
    where = {e: i for i, e in enumerate(eps)}
    for ax, key, metric in zip(axes, (f"ndcg{k}", f"hit{k}"), (f"NDCG@{k}", f"HIT@{k}")):
        for (method, clip), g in model_rows.groupby(["method", "clipping"]):
            g = g.groupby("eps")[key].mean()
            ax.plot([where[e] for e in g.index], g.values, marker="o", label=label(method, clip), color=model_color(method),
                    ls=":" if clip == "none" else "-")
        ax.set_xticks(range(len(eps)), ["∞" if e == float("inf") else f"{e:g}" for e in eps])
        pop = test[test["method"] == "popular"][key]
        if len(pop):
            ax.axhline(pop.mean(), ls="--", color="grey", label="most popular")
        ax.set_xlabel("ε")
        ax.set_ylabel(f"test {metric} (%)\nmean over seeds")  # two lines: a long label outgrew the panel
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()  # one legend for both panels, below them: never over a line
    ncol = _legend_columns(labels, 10)
    rows = -(-len(labels) // ncol)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 * rows + 0.02, 1, 1))
    return save(fig, path, dpi=120)


def _eps_text(eps: float) -> str:
    return "non-private" if eps == float("inf") else f"ε = {eps:g}"


NON_PRIVATE = "non-private"


def label(method: str, clipping: str) -> str:
    """A trained model's name in every table, legend and metric: ``transformer (non-private)``
    where it ran without DP (clipping=none), else the model's name."""
    return f"{method} ({NON_PRIVATE})" if clipping == "none" else method


def _legend_columns(labels, width_inches: float) -> int:
    """As many legend columns as fit the figure's width (about 0.06 inch a character at 8 pt, plus the handle)."""
    widest = max((len(str(t)) for t in labels), default=1)
    return max(1, min(len(labels), int(width_inches / (0.06 * widest + 0.5))))


def captions(k: int = 10) -> dict[str, str]:
    """What each of a sweep's figures shows and what its bars are (report.html's captions)."""
    return {
        "test_metrics.png": f"test NDCG@{k} and HIT@{k} (%) against eps: per model, the mean over its cells at each "
                            "eps (its seeds, and in a tuning grid every setting), no bars; the most-popular baseline dashed",
        "curves.png": f"validation NDCG@{k} (top) and HIT@{k} (bottom, %) per epoch, one column per eps: the mean over "
                      "seeds with a band of +-1 sd over seeds, one line per model and (in a tuning grid) per (learning "
                      "rate, batch size)",
        "grid.png": f"mean validation (top) and test (bottom) NDCG@{k} (%) over the (learning rate, batch size) grid, "
                    "one column per model and eps, each heatmap on its own colour scale; the red box is the setting "
                    "selected on validation",
        "attention.png": "the last block's attention mass on the positions that drove the test target against eps: "
                         "per model, the mean over its cells at each eps (its seeds, and in a tuning grid every setting) "
                         "with bars of +-1 sd over them; uniform attention dashed",
    }


def curves_figure(curves: pd.DataFrame, path: Path, k: int = 10) -> Path:
    """Figure 6: validation NDCG@k and HIT@k per epoch, mean and a +-1 sd band over seeds, one line
    per model; one column of panels per eps."""
    eps = sorted(curves["eps"].unique())
    fig, axes = plt.subplots(2, len(eps), figsize=(4.2 * len(eps), 6.4), squeeze=False, sharex=True)
    for j, e in enumerate(eps):
        sub = curves[curves["eps"] == e]
        for i, (key, metric) in enumerate(((f"ndcg{k}", f"NDCG@{k}"), (f"hit{k}", f"HIT@{k}"))):
            ax = axes[i, j]
            for (method, clip, lr, bs), g in sub.groupby(["method", "clipping", "lr", "batch_size"], sort=False):
                stats = g.dropna(subset=[key]).groupby("epoch")[key].agg(["mean", "std", "count"])
                line, = ax.plot(stats.index, stats["mean"], marker="o", ms=2.5, label=label(method, clip),
                                color=model_color(method), ls=":" if clip == "none" else "-")
                sd = stats["std"].fillna(0)
                ax.fill_between(stats.index, stats["mean"] - sd, stats["mean"] + sd, color=line.get_color(), alpha=0.2)
            ax.set_ylabel(f"validation {metric} (%)")
            ax.grid(alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
            if i == 0:
                ax.set_title(_eps_text(e), fontsize=10)
            else:
                ax.set_xlabel("epoch")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    ncol = _legend_columns(labels, 4.2 * len(eps))
    rows = -(-len(labels) // ncol)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.suptitle("Validation metrics per epoch (mean ± 1 sd over seeds)", fontsize=10)
    fig.tight_layout(rect=(0, 0.035 * rows + 0.02, 1, 1))  # room for the legend's rows, inside the figure
    return save(fig, path, dpi=120)


def grid_figure(results: pd.DataFrame, path: Path, k: int = 10) -> Path:
    """Figures 2 and 7: mean validation and test NDCG@k over the (learning rate, batch size) grid,
    one column of heatmaps per (model, eps); the setting selected on validation boxed."""
    cells = results[~results["method"].isin(BASELINES)]
    groups = list(cells.groupby(["method", "clipping", "eps"], sort=False))
    fig, axes = plt.subplots(2, len(groups), figsize=(3.6 * len(groups), 6.2), squeeze=False)
    for j, ((method, clip, eps), g) in enumerate(groups):
        for i, split in enumerate(("valid", "test")):
            ax = axes[i, j]
            m = g[g["split"] == split].pivot_table(index="batch_size", columns="lr", values=f"ndcg{k}", aggfunc="mean")
            im = ax.imshow(m.values, cmap="viridis", aspect="auto", origin="lower")
            for (r, c), v in np.ndenumerate(m.values):
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < np.nanmean(m.values) else "k")
            if split == "valid":
                r, c = np.unravel_index(np.nanargmax(m.values), m.shape)
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, ec="red", lw=2))
            ax.set_xticks(range(m.shape[1]), [f"{v:g}" for v in m.columns], fontsize=7)
            ax.set_yticks(range(m.shape[0]), [f"{int(v)}" for v in m.index], fontsize=7)
            ax.set_xlabel("learning rate")
            ax.set_ylabel("batch size B")
            ax.set_title(f"{label(method, clip)}, {_eps_text(eps)}\n{split} NDCG@{k} (%)", fontsize=9)
            bar = fig.colorbar(im, ax=ax, shrink=0.8)
            bar.formatter.set_useOffset(False)
            bar.update_ticks()
    fig.tight_layout()
    return save(fig, path, dpi=120)


def attention_figure(results: pd.DataFrame, path: Path) -> Path:
    """Attention distraction: the last block's attention mass on the positions that drove the test
    target, against eps (non-private at the right), mean and +-1 sd over seeds; chance dashed."""
    test = results[(results["split"] == "test") & results["attention_relevant"].notna()]
    eps = sorted(test["eps"].unique())
    where = {e: i for i, e in enumerate(eps)}
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for (method, clip), g in test.groupby(["method", "clipping"], sort=False):
        s = g.groupby("eps")["attention_relevant"].agg(["mean", "std"])
        ax.errorbar([where[e] for e in s.index], s["mean"], yerr=s["std"].fillna(0), marker="o", capsize=3,
                    label=label(method, clip), color=model_color(method), ls=":" if clip == "none" else "-")
    chance = test.groupby("eps")["attention_uniform"].mean()
    ax.plot([where[e] for e in chance.index], chance.values, ls="--", color="grey", marker="_", ms=14,
            label="uniform attention")  # the marker shows it even at a single eps
    ax.set_xticks(range(len(eps)), ["∞" if e == float("inf") else f"{e:g}" for e in eps])
    ax.set_xlabel("ε")
    ax.set_ylabel("attention mass on relevant positions")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()  # below the panel, as many columns as fit the width
    ncol = _legend_columns(labels, 6)
    rows = -(-len(labels) // ncol)
    fig.set_size_inches(6, 3.8 + 0.2 * rows)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, (0.2 * rows + 0.1) / (3.8 + 0.2 * rows), 1, 1))
    return save(fig, path, dpi=120)


def distraction(summary: pd.DataFrame, path: Path, k: int = 10) -> Path:
    """The distraction measurement (``pipeline/seqrec/distraction.py``) against eps: one column per
    noise model; rows: the last block's attention mass on tail-item positions, on the positions that
    drove the target (synthetic data only), and NDCG@k; noisy (no correction) and corrected (Re-
    Attention) with 95% intervals over the draws, the clean model dashed."""
    noises = list(dict.fromkeys(summary["noise"]))
    measures = [("tail", "attention mass on tail items")]
    if summary["relevant"].notna().any():
        measures.append(("relevant", "attention mass on relevant positions"))
    measures.append(("ndcg", f"test NDCG@{k} (%)"))
    fig, axes = plt.subplots(len(measures), len(noises), figsize=(4.2 * len(noises), 2.6 * len(measures)),
                             squeeze=False, sharex=True)
    colors = {"noisy": "#d62728", "corrected": "#1f77b4"}
    names = {"noisy": "noisy, no correction", "corrected": "noisy, Re-Attention"}
    for c, noise in enumerate(noises):
        part = summary[summary["noise"] == noise]
        for r, (measure, ylabel) in enumerate(measures):
            ax = axes[r][c]
            for variant, g in part.groupby("variant", sort=False):
                g = g.sort_values("eps")
                ax.errorbar(g["eps"], g[measure], yerr=g[f"{measure}_ci"].fillna(0), marker="o", capsize=3,
                            color=colors[variant], label=names[variant])
            ax.axhline(float(part[f"{measure}_clean"].iloc[0]), color="grey", ls="--", lw=1, label="trained without noise")
            ax.set_xscale("log")
            ax.set_xticks(sorted(part["eps"].unique()))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_ylabel(ylabel, fontsize=8)
            if r == 0:
                ax.set_title(f"noise: {noise}", fontsize=9)
            if r == len(measures) - 1:
                ax.set_xlabel("eps")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return save(fig, path, dpi=120)
