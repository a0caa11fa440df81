"""The end of a next-item sweep: its tables, figures, report and parent MLflow run.

``pipeline.sweep`` concatenates the cells' ``results.csv`` and hands them here, with the records
of the cells (their folders hold each cell's ``history.csv``). Written next to the sweep's
``results.csv`` (and copied to ``report.dir`` for DVC):

- ``table.csv`` / ``table.md`` (Tables 1 and 2): test NDCG@k and HIT@k, mean (sd) over the seeds
  of each (model, clipping, eps) at each (learning rate, batch size), the most-popular baseline as a
  row, and DPFormer's relative gain over the vanilla Transformer where both ran;
- ``test_metrics.png``: the test metrics against eps;
- ``curves.png`` (Figure 6): validation NDCG@k and HIT@k per epoch, mean and a +-1 sd band over
  seeds, one line per model, one panel per eps;
- where the learning rate or batch size varies (Figures 2 and 7): ``grid.png``, validation NDCG@k
  over the grid per model; ``grid.md`` / ``grid.csv``, per model and eps, the setting selected on
  validation with its test numbers, beside the best-on-test setting (the paper's protocol, which
  picks on the test set: reported for comparison only); ``table.md`` then shows each model at its
  setting selected on validation; ``selected.txt``, the overrides of the
  setting selected on validation for ``seqrec.select_for``; ``tuned.yaml``, every model's setting
  selected on validation (``pipeline/seqrec/tuning.py``: the DVC table stages run each model at
  its own, ``seqrec.tuned=...``);
- on synthetic data (attention mass measured): ``attention.png``, the last block's attention mass
  on the positions that drove the target against eps, chance level dashed;
- ``report.html`` with all of the above, and ``metrics.json`` (for ``dvc metrics show``).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from pipeline import report as reporting
from pipeline import intervals, sweep
from pipeline.seqrec import cell, plot, train, tuning
from pipeline.seqrec.evaluate import BASELINES
from pipeline.seqrec.plot import NON_PRIVATE, label

log = logging.getLogger(__name__)

def eps_label(eps: float) -> str:
    return "inf" if math.isinf(eps) else f"{eps:g}"


def _fmt(mean: float, sd: float) -> str:
    """"mean (sd)"; the mean alone where there is no sd (one seed)."""
    if pd.isna(mean):
        return ""
    return f"{mean:.2f}" if pd.isna(sd) else f"{mean:.2f} ({sd:.2f})"


def table(results: pd.DataFrame, k: int) -> pd.DataFrame:
    """Long form: one row per (model, clipping, eps, lr, batch size) of the test split, and one
    for the most-popular baseline; mean and sd over seeds of NDCG@k and HIT@k (%)."""
    test = results[results["split"] == "test"].copy()
    test["model"] = [label(m, c) if m not in BASELINES else m for m, c in zip(test["method"], test["clipping"])]
    models = test[~test["method"].isin(BASELINES)]
    keys = ["model", "clipping", "eps", "lr", "batch_size"]
    rows = []
    for key, g in models.groupby(keys, sort=False):
        rows.append(dict(zip(keys, key)) | _stats(g, k))
    popular = test[test["method"] == "popular"].drop_duplicates(["seed"])  # the same in every cell of a seed
    if len(popular):
        rows.append({"model": "popular", "clipping": "", "eps": math.nan, "lr": math.nan, "batch_size": math.nan}
                    | _stats(popular, k))
    return pd.DataFrame(rows)


def _stats(g: pd.DataFrame, k: int) -> dict:
    out = {"seeds": int(g["seed"].nunique())}
    for m in (f"ndcg{k}", f"hit{k}"):
        out[f"{m}_mean"] = float(g[m].mean())
        out[f"{m}_sd"] = float(g[m].std(ddof=1)) if len(g) > 1 else math.nan
    return out


def markdown(long: pd.DataFrame, k: int) -> tuple[pd.DataFrame, str]:
    """Tables 1-2's layout: one row per model, one column per eps, "NDCG (sd) / HIT (sd)";
    DPFormer's gain over the vanilla Transformer as a last row where both ran."""
    rows = long[long["model"] != "popular"]
    eps = sorted(rows["eps"].unique(), key=lambda e: (math.isinf(e), e))
    wide = []
    for model, g in rows.groupby("model", sort=False):
        row = {"model": model}
        for e in eps:
            hit = g[g["eps"] == e]
            if len(hit):
                r = hit.iloc[0]
                row[f"eps={eps_label(e)}"] = f"{_fmt(r[f'ndcg{k}_mean'], r[f'ndcg{k}_sd'])} / {_fmt(r[f'hit{k}_mean'], r[f'hit{k}_sd'])}"
        wide.append(row)
    pop = long[long["model"] == "popular"]
    if len(pop):
        r = pop.iloc[0]
        text = f"{_fmt(r[f'ndcg{k}_mean'], r[f'ndcg{k}_sd'])} / {_fmt(r[f'hit{k}_mean'], r[f'hit{k}_sd'])}"
        wide.append({"model": "most popular"} | {f"eps={eps_label(e)}": text for e in eps})
    frame = pd.DataFrame(wide).fillna("")
    text = (f"test NDCG@{k} (sd) / HIT@{k} (sd) in %, mean over seeds\n\n" + reporting.markdown_table(frame))
    return frame, text


VANILLA = "transformer"  # the model Re-Attention's variants (model names starting with "dpformer") are compared with


def gains(results: pd.DataFrame, long: pd.DataFrame, k: int, paper: float, level: float = 0.95,
          reference: str = VANILLA) -> pd.DataFrame:
    """Each Re-Attention variant's relative gain in test NDCG@k over ``reference`` (the vanilla
    Transformer; an ablation sweep: its own variant without correction, ``seqrec.gain_over``), per eps,
    as a paired comparison over seeds: per seed s, g_s = NDCG(variant, s) / NDCG(vanilla, s) - 1, the
    two at the settings ``long`` shows (selected on validation where a grid ran; the same seed gives
    both the same data split and the same streams), then the mean and its ``level`` Student-t interval
    over the seeds both ran. Verdict against the paper's claim of a gain of ``paper`` (0.2: "about
    20%"): ``reproduced`` where the interval lies above 0 (the paper's direction) and reaches
    ``paper`` (compatible with the claimed size); ``smaller than claimed`` where it lies above 0 and
    wholly below ``paper`` (a gain, but it excludes the claim: +1.1% [+0.75%, +1.52%] against +20%);
    ``contradicted`` where it does not lie above 0 and lies wholly below ``paper``; else
    ``inconclusive``; fewer than 2 paired seeds: no interval, ``inconclusive``."""

    test = results[(results["split"] == "test") & (results["clipping"] != "none")]
    shown = long[long["model"] != "popular"].set_index(["model", "eps"])
    out = []
    variants = [m for m in dict.fromkeys(test["method"]) if str(m).startswith("dpformer") and m != reference
                and not (train.uncorrected(m) and train.uncorrected(reference))]  # an ablation's controls: no gain to take
    for variant in variants:
        for e in sorted(test["eps"].unique(), key=lambda x: (math.isinf(x), x)):
            if (variant, e) not in shown.index or (reference, e) not in shown.index:
                continue
            per_seed = []
            for model in (variant, reference):
                at = shown.loc[(model, e)]
                sel = test[(test["method"] == model) & (test["eps"] == e) & (test["lr"] == at["lr"])
                           & (test["batch_size"] == at["batch_size"])]
                per_seed.append(sel.groupby("seed")[f"ndcg{k}"].mean())
            paired = pd.concat(per_seed, axis=1, keys=["v", "t"]).dropna()
            found = intervals.student_t(paired["v"] / paired["t"] - 1, level)
            n, mean, low, high = found.n, found.mean, found.low, found.high
            if n >= 2 and low > 0:
                verdict = "reproduced" if high >= paper else "smaller than claimed"
            elif n >= 2 and high < paper:
                verdict = "contradicted"
            else:
                verdict = "inconclusive"
            out.append({"variant": variant, "eps": e, "seeds": n, "gain_mean": mean, "ci_low": low, "ci_high": high,
                        "paper_gain": paper, "verdict": verdict})
    return pd.DataFrame(out, columns=["variant", "eps", "seeds", "gain_mean", "ci_low", "ci_high", "paper_gain",
                                      "verdict"])


def gains_caption(frame: pd.DataFrame, k: int, level: float = 0.95, reference: str = VANILLA) -> str:
    over = "the vanilla Transformer" if reference == VANILLA else reference
    return (f"Re-Attention's relative gain in test NDCG@{k} over {over}, paired over seeds "
            f"(mean and {level:.0%} t interval; the paper: about +{100 * frame['paper_gain'].iloc[0]:.0f}%)")


def gains_shown(frame: pd.DataFrame) -> pd.DataFrame:
    """The paired gains as table.md and report.html show them: percentages, the interval, the verdict."""
    rows = [{"variant": r.variant, "eps": eps_label(r.eps), "seeds": r.seeds, "gain": f"{100 * r.gain_mean:+.1f}%",
             "interval": "" if math.isnan(r.ci_low) else f"[{100 * r.ci_low:+.1f}%, {100 * r.ci_high:+.1f}%]",
             "verdict": r.verdict} for r in frame.itertuples()]
    return pd.DataFrame(rows, columns=["variant", "eps", "seeds", "gain", "interval", "verdict"])


def gains_markdown(frame: pd.DataFrame, k: int, level: float = 0.95, reference: str = VANILLA) -> str:
    return gains_caption(frame, k, level, reference) + "\n\n" + reporting.markdown_table(gains_shown(frame))


def is_grid(results: pd.DataFrame) -> bool:
    """Whether the sweep ran some model at more than one (lr, batch size) at one eps: a grid to select
    on. A table whose models each run at their own tuned setting (``seqrec.tuned``) is not one."""
    cells = results[~results["method"].isin(BASELINES)]
    per_cell = cells.groupby(["method", "clipping", "eps"])[["lr", "batch_size"]].nunique()
    return bool((per_cell > 1).any().any())


def grid(results: pd.DataFrame, k: int) -> pd.DataFrame:
    """Per (model, clipping, eps): the (lr, batch size) selected on mean validation NDCG@k, its test
    numbers, and the best-on-test setting (the paper's protocol)."""
    keys = ["method", "clipping", "eps", "lr", "batch_size"]
    cells = results[~results["method"].isin(BASELINES)]
    mean = cells.pivot_table(index=keys, columns="split", values=f"ndcg{k}", aggfunc="mean").reset_index()
    hit = cells[cells["split"] == "test"].groupby(keys)[f"hit{k}"].mean().rename("test_hit").reset_index()
    mean = mean.merge(hit, on=keys)
    rows = []
    for (method, clip, eps), g in mean.groupby(["method", "clipping", "eps"], sort=False):
        sel, best = g.loc[g["valid"].idxmax()], g.loc[g["test"].idxmax()]
        rows.append({"model": label(method, clip), "method": method, "eps": eps,
                     "selected_lr": sel["lr"], "selected_batch_size": int(sel["batch_size"]),
                     f"valid_ndcg{k}": sel["valid"], f"test_ndcg{k}": sel["test"], f"test_hit{k}": sel["test_hit"],
                     "best_on_test_lr": best["lr"], "best_on_test_batch_size": int(best["batch_size"]),
                     f"best_on_test_ndcg{k}": best["test"], f"best_on_test_hit{k}": best["test_hit"]})
    return pd.DataFrame(rows)


def selected_overrides(picks: pd.DataFrame, method: str) -> str:
    """``seqrec.lr=... seqrec.batch_size=...`` of ``method``'s setting selected on validation."""
    row = picks[picks["method"] == method]
    if row.empty:
        raise ValueError(f"seqrec.select_for {method!r} did not run in this sweep; ran: {sorted(picks['method'])}")
    r = row.iloc[0]
    return f"seqrec.lr={r['selected_lr']:g} seqrec.batch_size={int(r['selected_batch_size'])}"


def histories(cells: sweep.Cells, results: pd.DataFrame) -> pd.DataFrame:
    """Every cell's ``history.csv`` with its model, clipping, eps, lr, batch size and seed (from
    the cell's rows of ``results``)."""
    frames = []
    for record, rows in cells.rows(results):
        path = Path(record["folder"]) / "history.csv"
        if not path.exists():
            continue
        row = rows[~rows["method"].isin(BASELINES)].iloc[0]
        h = pd.read_csv(path)
        for key in ("method", "clipping", "eps", "lr", "batch_size", "seed"):
            h[key] = row[key]
        frames.append(h)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def summarise(config: DictConfig, sweep_id: str, sweep_dir: Path, cells: sweep.Cells, results: pd.DataFrame,
              csv: Path) -> None:
    """Write the sweep's tables, figures and report; log them to the parent run; copy to report.dir."""
    k = int(config.seqrec.k)
    sweep_dir = Path(sweep_dir)
    artifacts: list[Path] = [Path(csv)]
    long = table(results, k)
    long.to_csv(sweep_dir / "table.csv", index=False)
    artifacts.append(sweep_dir / "table.csv")
    figures = [plot.sweep_figure(results, sweep_dir / "test_metrics.png", k)]
    curves = histories(cells, results)
    if not curves.empty and f"ndcg{k}" in curves:
        figures.append(plot.curves_figure(curves, sweep_dir / "curves.png", k))
    picks = None
    if is_grid(results):  # select on validation
        picks = grid(results, k)
        picks.to_csv(sweep_dir / "grid.csv", index=False)
        (sweep_dir / "grid.md").write_text(
            f"Per model and eps: the (learning rate, batch size) with the best mean validation NDCG@{k} and its test "
            f"numbers; beside it the best-on-test setting (the paper's protocol, for comparison only)\n\n"
            + reporting.markdown_table(picks.drop(columns="method").round(3)))
        figures.append(plot.grid_figure(results, sweep_dir / "grid.png", k))
        artifacts += [sweep_dir / "grid.csv", sweep_dir / "grid.md", tuning.write(picks, sweep_dir / "tuned.yaml", k)]
        chosen = config.seqrec.get("select_for")
        if chosen:
            (sweep_dir / "selected.txt").write_text(selected_overrides(picks, chosen) + "\n")
            artifacts.append(sweep_dir / "selected.txt")
        selected = picks.rename(columns={"selected_lr": "lr", "selected_batch_size": "batch_size"})
        long = pd.concat([long.merge(selected[["model", "eps", "lr", "batch_size"]]),
                          long[long["model"] == "popular"]], ignore_index=True)
    frame, text = markdown(long, k)
    reference = str(config.seqrec.get("gain_over") or VANILLA)
    paired = gains(results, long, k, float(config.seqrec.get("paper_gain", 0.2)), reference=reference)
    if len(paired):
        paired.to_csv(sweep_dir / "gains.csv", index=False)
        text += "\n" + gains_markdown(paired, k, reference=reference)
        artifacts.append(sweep_dir / "gains.csv")
    (sweep_dir / "table.md").write_text(text)
    artifacts.append(sweep_dir / "table.md")
    shown = frame if picks is None else picks.drop(columns="method").round(3)
    if "attention_relevant" in results and results["attention_relevant"].notna().any():
        figures.append(plot.attention_figure(results, sweep_dir / "attention.png"))
    artifacts += figures
    name = config.get("experiment_name") or "seqrec sweep"
    config_yaml = OmegaConf.to_yaml(own_config(config), resolve=True)
    runs = [(" ".join(r.get("overrides") or []), r["run_id"], r.get("compute") or {}) for r in cells.done]
    if picks is None:
        caption = (f"test NDCG@{k} and HIT@{k} (%), mean (sd) over seeds: one row per model, one column per eps "
                   f"(table.md holds the same)")
    else:
        caption = (f"per model and eps: the (learning rate, batch size) with the best mean validation NDCG@{k}, its "
                   f"validation and test NDCG@{k} (%), means over seeds; beside it the best-on-test setting (the "
                   f"paper's protocol, for comparison only)")
    tables = [(gains_caption(paired, k, reference=reference) + ", verdict against the paper's claim",
               gains_shown(paired))] if len(paired) else []
    page = reporting.write_html(sweep_dir / "report.html", f"{name}: {len(cells.done)} cells", sweep.command(),
                                config_yaml, shown, figures, runs, caption=caption,
                                swept=reporting.grid([r.get("overrides") or [] for r in cells.done]),
                                tables=tables, captions=plot.captions(k),
                                **sweep.report_links(config, cells))
    artifacts.append(page)
    metrics = {f"{row.model.replace(f' ({NON_PRIVATE})', '.nonprivate')}.eps_{eps_label(row.eps)}.test_ndcg{k}":
               row._asdict()[f"ndcg{k}_mean"]
               for row in long[long["model"] != "popular"].itertuples()}
    print(f"\n{name}: {text}\nreport: {page}", flush=True)
    sweep.parent_run(config, sweep_id, sweep_dir, cells, f"{name} ({len(cells.done)} cells)",
                     list(map(str, artifacts)), {"dataset": config.dataset.name},
                     {key.replace("=", "_"): v for key, v in metrics.items() if not math.isnan(v)}, text,
                     (list(cell.HEADLINE_PARAMS), [f"test_ndcg{k}", f"test_hit{k}"]))
    sweep.publish(config, artifacts, {"cells": len(cells.done), **metrics})

    log.info("sweep of %d cells: wrote %s", len(cells.done), ", ".join(str(p) for p in artifacts))


NOT_SEQREC = ("trials", "oracle", "plot", "evaluate", "regime", "attack", "method")  # NoisyHead's keys


def own_config(config) -> dict:
    """The config a DPFormer report shows: without Hydra's keys and NoisyHead's (``trials``, ``plot``,
    ``privacy.accountant``, NoisyHead's ``compute`` keys, ...), which a DPFormer run does not read."""
    shown = {key: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
             for key, v in config.items() if key not in ("hydra", *NOT_SEQREC)}
    shown.get("privacy", {}).pop("accountant", None)
    for key in ("dtype", "chunk_trials", "threads"):
        shown.get("compute", {}).pop(key, None)
    return shown
