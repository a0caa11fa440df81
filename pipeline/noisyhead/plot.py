"""NoisyHead's plot step: figures and tables drawn from ``results.csv`` rows, for one cell or a
whole sweep.

What goes on the axes is configuration (``conf/config.yaml: plot``): ``x`` (auto: T when
a cell has several horizons, else N), one line per ``hue`` value (auto: eps when it
varies), one panel per method or all methods in one panel, and error bars of
``k_sd`` standard deviations across trials, either of the excess risk itself
(``error_bars: sd``) or of its log10 (``log_sd``, for log-scale figures).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from pipeline.plot import color, dodged, save, symbol  # first: it sets matplotlib's Agg backend

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from pipeline.noisyhead.evaluate import ZERO  # noqa: E402

AXES = {"N": "$N$ (training prompts)", "T": "$T$ (gradient steps)", "eps": r"privacy budget $\varepsilon$",
        "attack_c": "$c$", "attack_p": r"$p$ (perturbation $\alpha = c N^p$)", "attack_alpha": r"$\alpha$"}
MEASURES = {"excess_risk": "excess risk vs ridge", "attack_risk": "attack risk", "test_mse": "test MSE"}

def _auto(df: pd.DataFrame, spec: DictConfig) -> tuple[str, str | None]:
    x = spec.x
    if x == "auto":
        x = "T" if df["T"].nunique() > 1 and df["N"].nunique() == 1 else "N"
    hue = spec.hue
    if hue == "auto":
        hue = "eps" if df["eps"].nunique() > 1 else None
    return x, hue


def _series(row, labels: dict[str, str]) -> str:
    name = labels.get(row["method"], row["method"])
    coupling = row.get("coupling")
    return f"{name}, {coupling} noise" if coupling in ("independent", "shared") else name


def measures(spec: DictConfig) -> list[str]:
    """The measures ``spec.y`` names (one, or a list)."""
    y = spec.get("y", "excess_risk")
    return [y] if isinstance(y, str) else list(y)


def shown(df: pd.DataFrame, spec: DictConfig) -> pd.DataFrame:
    """The rows of the methods ``spec.methods`` names (null: every method but the ridge oracle), and
    the zero predictor's (``evaluate.ZERO``), the reference every table and figure shows."""
    methods = list(spec.methods) if spec.methods else [m for m in df["method"].unique() if m != "ridge"]
    return df[df["method"].isin([*methods, ZERO])]


def reference(df: pd.DataFrame, x: str, y: str) -> pd.Series | None:
    """The zero predictor's mean ``y`` at each ``x`` (the mean over the cells there, which share their
    data: the same N gives the same prompts at every eps); None where it has no ``y`` (attack risk)."""
    zero = df[(df["method"] == ZERO) & df[f"{y}_mean"].notna()]
    return zero.groupby(x)[f"{y}_mean"].mean() if len(zero) else None


def figures(df: pd.DataFrame, spec: DictConfig, folder: Path, labels: dict[str, str] | None = None) -> list[Path]:
    """One figure per measure, ``folder/<measure>.png``."""
    return [figure(df, spec, folder / f"{y}.png", labels, y=y) for y in measures(spec)]


def figure(df: pd.DataFrame, spec: DictConfig, path: Path, labels: dict[str, str] | None = None,
           y: str | None = None) -> Path:
    """``y`` (default ``spec.y``: excess_risk, attack_risk, test_mse) against ``spec.x``, one line per
    ``hue`` value (or per method when hue is null), one panel per value of ``spec.facet`` (a column,
    or none), with +-k sd error bars; saved as PNG. ``labels`` names the methods."""
    labels = labels or {}
    y = y or measures(spec)[0]
    df = shown(df, spec).copy()
    df = df[df[f"{y}_mean"].notna()]
    zero = df[df["method"] == ZERO]
    df = df[df["method"] != ZERO]
    x, hue = _auto(df, spec)
    k = float(spec.k_sd)
    if spec.error_bars == "log_sd":
        mean, sd = df[f"log10_{y}_mean"], df[f"log10_{y}_sd"]
        df["y"] = 10**mean
        df["lo"] = df["y"] - 10 ** (mean - k * sd)
        df["hi"] = 10 ** (mean + k * sd) - df["y"]
    else:
        df["y"] = df[f"{y}_mean"]
        df["lo"] = df["hi"] = k * df[f"{y}_sd"]
        if spec.yscale == "log":  # a bar below zero cannot be drawn on a log axis
            df["lo"] = np.minimum(df["lo"], df["y"] * (1 - 1e-3))
    df["series"] = [_series(r, labels) for _, r in df.iterrows()]
    facet = spec.facet if spec.facet not in (None, "none") else None
    panels = sorted(df[facet].unique()) if facet else [None]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.0), squeeze=False)
    key = hue or "series"
    values = sorted(df[key].unique())
    method = dict(zip(df["series"], df["method"]))
    if hue:  # colours encode the hue's value (eps, ...): a sequential palette
        colors = dict(zip(values, sns.color_palette("viridis", len(values))))
    else:  # colours encode the method: the same in every figure (pipeline.plot.COLORS)
        colors = {v: color(method[v]) for v in values}
    styles = _styles(values, {} if hue else method)
    for name, colour in (spec.get("colors") or {}).items():  # a preset's colours, by method name or legend text
        for series in (name, labels.get(name, name)):
            if series in colors:
                colors[series] = colour
    xlog = x == "N" and df[x].nunique() > 2 and df[x].max() / max(df[x].min(), 1e-300) >= 20
    for ax, panel in zip(axes[0], panels):
        sub = df if panel is None else df[df[facet] == panel]
        ref = reference(zero if panel is None or facet == "method" else zero[zero[facet] == panel], x, y)
        if ref is not None:  # a thin dashed black line over the series (so that it shows where a series
            # sits on it, as every method's test MSE does in beyond_lowdim): what predicting 0 scores
            style = dict(ls="--", lw=1, color=color(ZERO), label=labels.get(ZERO, ZERO), zorder=3)
            if len(ref) == 1:  # one x: across the panel
                ax.axhline(float(ref.iloc[0]), **style)
            else:
                ax.plot(ref.index, ref.values, **style)
        at_x = {v: sorted(set(s), key=values.index) for v, s in sub.groupby(x)[key]}  # the series at each x
        for value, g in sub.groupby(key):
            g = g.sort_values(x)
            label = f"{symbol(hue)} = {value:g}" if hue else value
            at = dodged(g[x], [at_x[v].index(value) for v in g[x]], [len(at_x[v]) for v in g[x]],
                        sub[x].to_numpy(), xlog)
            ax.errorbar(at, g["y"], yerr=[g["lo"], g["hi"]], marker=styles[value][1], ms=4, capsize=3, label=label,
                        color=colors[value], ls=styles[value][0])
        ax.set_xlabel(AXES.get(x, symbol(x)))
        ax.set_ylabel(MEASURES.get(y, y.replace("_", " ")))
        ax.set_yscale(spec.yscale)
        if xlog:
            ax.set_xscale("log")
        if panel is not None:
            name = labels.get(panel, panel) if facet == "method" else f"{symbol(facet)} = {panel:g}"
            ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    handles, names = axes[0][0].get_legend_handles_labels()
    seen = dict(zip(names, handles))
    for ax in axes[0][1:]:
        for h, n in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(n, h)
    rows = _legend(fig, list(seen.values()), list(seen.keys()), ncol=min(len(seen), 3 if len(panels) == 1 else 4))
    if spec.title:  # wrapped to the figure's width (about 12 characters an inch at 10 pt)
        fig.suptitle(textwrap.fill(str(spec.title), int(12 * 5.0 * len(panels))), fontsize=10)
    height = 3.5 + 0.25 * rows  # the panels keep their height whatever the legend's rows
    fig.set_size_inches(fig.get_figwidth(), height)
    fig.tight_layout(rect=(0, (0.25 * rows + 0.1) / height, 1, 1))  # tight_layout leaves room for the suptitle
    return save(fig, path)


LINES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]


def _styles(values: list, method: dict) -> dict:
    """(line style, marker) of each series: solid with circles, except where one method has several
    series (Figure 4's independent and shared noise), which share the method's colour and take the
    next styles in turn, so that no two series of a figure look alike."""
    taken: dict[str, int] = {}
    styles = {}
    for v in values:
        m = method.get(v, v)
        styles[v] = LINES[taken.get(m, 0) % len(LINES)]
        taken[m] = taken.get(m, 0) + 1
    return styles


def _legend(fig, handles: list, names: list, ncol: int) -> int:
    """The figure's legend below its panels (never over data), in at most ``ncol`` columns and as
    few fewer as it takes to fit the figure's width (long method names ran off both edges); its rows."""
    ncol = max(ncol, 1)
    while True:
        legend = fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
        if ncol == 1 or legend.get_window_extent(fig.canvas.get_renderer()).width <= 0.98 * fig.bbox.width:
            return -(-len(names) // ncol)
        legend.remove()
        ncol -= 1


def table(df: pd.DataFrame, rows: list[str], values: str | list[str],
          labels: dict[str, str] | None = None) -> tuple[pd.DataFrame, str]:
    """One row per combination of ``rows``, one column per method: "mean (sd)" of each of ``values``
    (one Markdown table per value). Returns the numeric table (``<method>_<value>_mean`` and
    ``_sd`` columns) and its Markdown rendering."""
    labels = labels or {}
    values = [values] if isinstance(values, str) else list(values)
    methods = list(dict.fromkeys(df["method"]))
    stats = [f"{v}_{s}" for v in values for s in ("mean", "sd")]
    wide = df.pivot_table(index=rows, columns="method", values=stats, sort=True)
    header = [*rows, *(labels.get(m, m) for m in methods)]
    lines = []
    for value in values:
        if len(values) > 1:
            lines += ["", f"**{value.replace('_', ' ')}**, mean (sd) across trials", ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for key, row in wide.iterrows():
            key = key if isinstance(key, tuple) else (key,)
            cells = [f"{k:g}" for k in key]
            cells += [f"{row[(f'{value}_mean', m)]:.4g} ({row[(f'{value}_sd', m)]:.2g})" for m in methods]
            lines.append("| " + " | ".join(cells) + " |")
    if len(values) == 1:
        wide.columns = [f"{m}_{stat.removeprefix(values[0] + '_')}" for stat, m in wide.columns]
    else:
        wide.columns = [f"{m}_{stat}" for stat, m in wide.columns]
    return wide.reset_index(), "\n".join(lines).lstrip("\n") + "\n"
