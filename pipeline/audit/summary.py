"""A DVC stage's whole-run audits over seeds and claims, in one table: ``python -m
pipeline.audit.summary ROOT`` (each audit's own row is ``pipeline.audit.run``)."""

from __future__ import annotations

import math
from pathlib import Path

# --- a stage's audits over seeds and claims -------------------------------------------------------

LABEL = r"eps(?P<claim>[0-9.]+)-(?P<model>tied|untied)-seed(?P<seed>\d+)(?:-(?P<part>\w+))?"


def summarize(root: Path) -> "pd.DataFrame":  # noqa: F821
    """A DVC stage's audits, one folder each under ``root/runs`` named ``eps<claim>-<tied|untied>-seed<s>``
    (optionally ``-<part>``), each holding that audit's ``audit.csv``: every row with its claim, model
    and seed in ``root/audit.csv``; ``root/audit.md``, per (claim, model, variant, canaries), the
    seeds, how many were flagged (a proof: Steinke's bound above the claim, or the f-DP test rejecting
    the accountant's curve; each counted), each proof's median and range, the estimates' medians
    (beside, never flagged: ``estimates_above`` counts those above the claim), the ceilings, the power
    and the smallest sanity p; ``root/metrics.json``, the same in numbers. Returns the per-group table."""
    import json
    import re

    import pandas as pd

    frames = []
    for folder in sorted((root / "runs").iterdir()):
        found = re.fullmatch(LABEL, folder.name)
        if found is None or not (folder / "audit.csv").is_file():
            continue
        table = pd.read_csv(folder / "audit.csv")
        frames.append(table.assign(claim=float(found["claim"]), model=found["model"], seed=int(found["seed"]),
                                   folder=folder.name))
    if not frames:
        raise FileNotFoundError(f"no audit folder named like {LABEL!r} with an audit.csv under {root / 'runs'}")
    rows = pd.concat(frames, ignore_index=True)
    rows.to_csv(root / "audit.csv", index=False)
    groups = []
    for (claim, model, variant, canaries), g in rows.groupby(["claim", "model", "variant", "canaries"], sort=False):
        proof = g["verdict"].str.startswith("violation")
        above = g["best_estimate"].gt(g["claim"]) & ~proof
        groups.append({"claim": claim, "model": model, "variant": variant, "canaries": canaries, "seeds": len(g),
                       "m": int(g["m"].iloc[0]), "proofs": int(proof.sum()), "flagged": int(proof.sum()),
                       "steinke_proofs": int(g["eps_lower"].gt(g["claim"]).sum()),
                       "fdp_proofs": int(g["fdp_p"].le(1 - g["confidence"]).sum()),
                       "estimates_above": int(above.sum()),
                       **{f"{k}_median": float(g[k].median()) for k in ("eps_lower", "fdp_eps_proved", "best_proved",
                                                                         "gauss_eps_estimate", "gdp_eps_estimate",
                                                                         "sum_eps_lower", "fdp_p")},
                       **{f"{k}_min": float(g[k].min()) for k in ("eps_lower", "fdp_eps_proved", "best_proved")},
                       **{f"{k}_max": float(g[k].max()) for k in ("eps_lower", "fdp_eps_proved", "best_proved", "fdp_p")},
                       "eps_ceiling": float(g["eps_ceiling"].iloc[0]), "fdp_ceiling": float(g["fdp_ceiling"].iloc[0]),
                       "gauss_ceiling": float(g["gauss_ceiling"].iloc[0]), "gdp_ceiling": float(g["gdp_ceiling"].iloc[0]),
                       "power_median": float(g["power"].median()), "sanity_p_min": float(g["sanity_p"].min())})
    summary = pd.DataFrame(groups)
    f = (lambda v: "-" if not math.isfinite(v) else f"{v:.2f}")
    lines = [f"Whole-run audits over seeds ({rows['seed'].nunique()} seeds; {100 * rows['confidence'].iloc[0]:.0f}% "
             "confidence). Proofs: Steinke's lower bound on eps, and the f-DP test of the scores against the curve of the "
             "mechanism the accountant composed (a rejection proves the run is not that mechanism; 'eps >=' is the eps "
             "of the most private run of its family, same q and steps, that the scores reject). Flagged = a proof. "
             "Estimates (true only if the run's trade-off is Gaussian, never a proof): f-DP and GDP, medians. Each "
             "number the median over the seeds, [min, max] for the proofs\n",
             "| claim | model | variant | canaries | m | seeds | flagged (Steinke / f-DP test) | proof: Steinke eps >= "
             "| proof: f-DP test eps >= | f-DP test p, largest | estimates: f-DP / GDP | sum statistic: Steinke "
             "| ceilings: Steinke / f-DP test | power | smallest sanity p |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary.itertuples():
        lines.append(f"| {r.claim:g} | {r.model} | {r.variant} | {r.canaries} | {r.m} | {r.seeds} | {r.flagged} "
                     f"({r.steinke_proofs} / {r.fdp_proofs}) | {r.eps_lower_median:.2f} [{r.eps_lower_min:.2f}, "
                     f"{r.eps_lower_max:.2f}] | {f(r.fdp_eps_proved_median)} [{f(r.fdp_eps_proved_min)}, "
                     f"{f(r.fdp_eps_proved_max)}] | {r.fdp_p_max:.2g} | {f(r.gauss_eps_estimate_median)} / "
                     f"{f(r.gdp_eps_estimate_median)} | {f(r.sum_eps_lower_median)} | {r.eps_ceiling:.2f} / "
                     f"{f(r.fdp_ceiling)} | {r.power_median:.2f} | {f(r.sanity_p_min)} |")
    (root / "audit.md").write_text("\n".join(lines) + "\n")
    metrics = {f"eps{r['claim']:g}.{r['model']}.{r['variant']}.{r['canaries']}.{k}": r[k] for r in groups
               for k in ("seeds", "flagged", "steinke_proofs", "fdp_proofs", "estimates_above", "eps_lower_median",
                         "fdp_eps_proved_median", "fdp_eps_proved_min", "best_proved_median", "best_proved_min",
                         "gauss_eps_estimate_median", "gdp_eps_estimate_median", "fdp_p_max") if math.isfinite(r[k])}
    (root / "metrics.json").write_text(json.dumps(metrics | {"runs": len(rows)}, indent=1) + "\n")
    print(f"wrote audit.csv, audit.md and metrics.json to {root}: {len(rows)} audited runs in {len(groups)} groups",
          flush=True)
    return summary


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipeline.audit.summary",
                                     description="Summarise a DVC stage's whole-run audits over seeds and claims.")
    parser.add_argument("root", type=Path, help="the stage's artifacts folder (its audits in ROOT/runs/eps<claim>-"
                        "<tied|untied>-seed<s>[-<part>])")
    summarize(parser.parse_args().root)
