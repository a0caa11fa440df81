"""Canary-user privacy audit of one DP-SGD step of the next-item task: ``python -m pipeline.audit
experiment=dpformer_ci`` (any config with ``task: seqrec``; ``pipeline/audit/__main__.py`` hands it here).

What is audited. One DP-SGD step on a fixed batch of users releases S(D) + sigma C N(0, I), with
S(D) = sum_i c_i g_i the clipping engine's clipped sum (``train.dp_gradient``; dividing by the
expected batch size B is post-processing and left out). With every ||c_i g_i|| <= C the step is the
Gaussian mechanism of sensitivity C (add or remove one user), so it is (eps, delta)-DP exactly when
sigma is at least the analytic Gaussian multiplier of (eps, delta) (Balle and Wang;
``privacy.gaussian_multiplier``, dp-accounting). The audit runs the step at that sigma for the
claimed ``privacy.eps`` and ``privacy.delta``: the claim is exact (no accountant slack, no
subsampling, no composition), so a clipping or noise bug that raises the step's true eps shows up
as a violation. A training run's sigma is another number, but what its guarantee rests on per step
is the same: the engine's bound ||c_i g_i|| <= C and noise of std sigma C. ``audit.seqrec.sigma:
run`` audits the step at the run's own multiplier instead (``train.plan``: the accountant's sigma
for ``privacy.eps`` over the run's sampling rate and steps), against that one step's exact claim,
the eps of a single Gaussian mechanism with that multiplier at ``privacy.delta``; a larger claim
needs more runs to be tested (``eps_power``).

Neighbouring batches: D' = the first ``audit.seqrec.users`` users of the training rows (default
``seqrec.batch_size``) and D = D' plus a canary user whose L + 1 items all are the item rarest in
D' (the least frequent; ties: the smallest id). Per-user clipping makes the others' terms identical
in both sums, so S(D) - S(D') is the canary's clipped gradient exactly. The model is the configured
one at its initialisation (``seed``), dropout off, so S is deterministic: each sum is computed once
by the real engine (``clipping.make``, ``engine.step``), and the ``audit.runs`` releases per batch
only redraw the noise, full vectors (runs x parameters, in chunks of ``compute.chunk_trials``).
Each release is projected on u = (S(D) - S(D')) / ||S(D) - S(D')||, the likelihood-ratio statistic
of the Gaussian pair; u depends on no noise draw, so ``pipeline.bounds.eps_lower_bound`` (threshold
chosen on the first ``audit.select_fraction`` of the runs, Clopper-Pearson on the rest) stays a
valid lower bound, and ``eps_power`` / ``verdict`` say whether a bound below the claim means
anything.

Variants (``audit.seqrec.controls`` adds the negative controls, each of which the audit must flag):

- ``engine``: the configured engine, noise std sigma C times ``audit.noise_scale`` (1);
- ``noise_halved``: the same engine, noise std halved (true eps about 2.3 for a claim of 1);
- ``one_branch``: :class:`OneBranchPhantom`, a test double of Phantom Clipping with fastDP's bug:
  the tied item table's per-user norm taken from its input-lookup branch only (the output scores'
  branch and the cross term dropped, as when the lookup's norm overwrites the output layer's), so
  c_i is too large and ||c_i g_i|| exceeds C. At initialisation the output branch carries most of
  a user's gradient, so the canary's clipped norm is several times C.
"""

from __future__ import annotations

import logging
from dataclasses import asdict

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, OmegaConf

from pipeline import plot, privacy, progress, rng, tracking, validation
from pipeline.audit import bounds
from pipeline.validation import ConfigError
from pipeline.seqrec import clipping, config, data, train
from pipeline.clipping import PhantomClipping

log = logging.getLogger(__name__)

CONTROLS = ("noise_halved", "one_branch")


class OneBranchPhantom(PhantomClipping):
    """TEST DOUBLE, for the audit's negative control only (no config key reaches it from training):
    Phantom Clipping with fastDP's shared-embedding bug. A parameter used in two ways (the tied item
    table's lookup and scores) gets the norm of its first use only, so the item table's per-user
    norm is ||grad_in|| instead of ||grad_in + grad_out||; the clipped sum is still sum_i c_i g_i of
    the true gradients, with the too large c_i. The guard does not see it: every use is recorded, the
    bug is in the norm's arithmetic."""

    def __init__(self, model, clip):
        super().__init__(model, C=float(clip.C), rule=str(clip.rule), gamma=float(clip.gamma),
                         sum_by=str(clip.get("sum_by", "bookkeeping")), form=str(clip.get("norm_form", "auto")))

    def _sq_norms(self, uses, n, stacks=None):
        def one(found):  # the lookup (an index use) where there is one: the input branch
            return [u for u in found if getattr(u, "index", False)][:1] or found[:1]
        return super()._sq_norms({pid: one(found) for pid, found in uses.items()}, n)  # its own stacks


def claim(cfg: DictConfig, n_users: int) -> tuple[float, float, float]:
    """(sigma, eps, delta) of the audited step: ``audit.seqrec.sigma: claim``: the analytic Gaussian
    multiplier of (privacy.eps, privacy.delta); ``run``: the run's DP-SGD multiplier and the exact eps
    of one Gaussian step with it at privacy.delta."""
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    if cfg.audit.seqrec.sigma == "run":
        sigma = train.plan(cfg, n_users).sigma
        return sigma, privacy.spent_epsilon(multiplier=sigma, T=1, delta=delta), delta
    return privacy.gaussian_multiplier(eps=eps, delta=delta), eps, delta


SIGMAS = ("claim", "run")


def validate(cfg: DictConfig) -> list[str]:
    """Check the config (the task's own checks, the audit's keys, the seqrec audit's); return the
    variants to audit."""
    config.validate(cfg)
    validation.threads(cfg.compute.threads, "compute.threads")
    bounds.check_keys(cfg.audit)
    s = cfg.audit.seqrec
    if s.users is not None:
        config._int(s.users, "audit.seqrec.users", 1)
    if s.sigma not in SIGMAS:
        raise ConfigError(f"audit.seqrec.sigma {s.sigma!r} is unknown; known: {list(SIGMAS)}")
    if not np.isfinite(float(cfg.privacy.eps)):
        raise ConfigError("privacy.eps=inf: a step without noise makes no claim to audit")
    controls = list(s.controls or [])
    for name in controls:
        if name not in CONTROLS:
            raise ConfigError(f"audit.seqrec.controls: {name!r} is unknown; known: {list(CONTROLS)}")
    if cfg.clipping.name == "none":
        raise ConfigError("clipping.name='none' is the non-private engine: nothing to audit (use phantom, per_sample or ghost)")
    if cfg.model.get("reattention") is not None:
        raise ConfigError(f"model={cfg.model.name}: the seqrec audit runs the models without Re-Attention")
    if "one_branch" in controls and not (cfg.clipping.name == "phantom" and cfg.model.tied):
        raise ConfigError(f"audit.seqrec.controls: one_branch is a bug of the tied item table under Phantom Clipping; "
                          f"it needs clipping=phantom and a tied model, got clipping={cfg.clipping.name} model={cfg.model.name}")
    return ["engine", *controls]


def batches(seqs: data.Sequences, users: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The canary batch D (canary last) and its neighbour D' (the first ``users`` training rows), and
    the canary's item: the one least frequent in D' (ties: the smallest id), repeated L + 1 times."""
    rows = seqs.train[:users]
    counts = torch.bincount(rows.flatten(), minlength=seqs.n_items + 1)[1:]
    item = int(torch.argmin(counts)) + 1
    canary = torch.full((1, rows.shape[1]), item, dtype=rows.dtype)
    return torch.cat([rows, canary]), rows, item


def engine_for(variant: str, model, cfg: DictConfig):
    if variant == "one_branch":
        return clipping.phantom(model, cfg.clipping, engine=OneBranchPhantom(model, cfg.clipping))
    return clipping.make(cfg.clipping.name, model, cfg.clipping)


def model_for(cfg: DictConfig, seqs: data.Sequences, dtype) -> torch.nn.Module:
    """The audited model: the configured one at its initialisation (``seed``), dropout off."""
    torch.manual_seed(int(cfg.seed))
    return train.build(OmegaConf.merge(cfg.model, {"dropout": 0.0}), seqs.n_items, seqs.L).to(dtype)


def clipped_sum(variant: str, cfg: DictConfig, seqs: data.Sequences, rows: torch.Tensor, dtype) -> torch.Tensor:
    """S = sum_i c_i g_i over ``rows``, flattened over the trainable parameters, from the engine
    through ``train.dp_gradient`` without noise (and B = 1), on a fresh ``model_for``."""
    model = model_for(cfg, seqs, dtype)
    engine = engine_for(variant, model, cfg)
    train.dp_gradient(engine, model, rows[:, :-1], rows[:, 1:], sigma=0.0, C=float(cfg.clipping.C),
                         expected_batch=1, generator=None)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]).detach()


def releases(S: torch.Tensor, u: torch.Tensor, *, std: float, runs: int, chunk: int, seed: int, stream: str) -> np.ndarray:
    """<S + std Z_r, u> for r < runs: full noise vectors Z_r ~ N(0, I) (float32, one generator per
    chunk of runs in ``stream``), projected on u."""
    base = float(S.double() @ u.double())
    u32 = u.float()
    out = np.empty(runs)
    for k, start in enumerate(range(0, runs, chunk)):
        n = min(chunk, runs - start)
        Z = torch.empty(n, S.numel(), dtype=torch.float32).normal_(generator=rng.generator(seed, stream, k))
        out[start:start + n] = base + std * (Z @ u32).double().numpy()
    return out


def measure(variant: str, cfg: DictConfig, seqs, D: torch.Tensor, D_: torch.Tensor) -> tuple[dict, np.ndarray, np.ndarray, bounds.Bound]:
    """One variant's audit, without logging: its row (bound, power, verdict, the canary's clipped
    norm and the step's true eps from it), and the statistic on both batches' releases."""
    a = cfg.audit
    sigma, eps, delta = claim(cfg, seqs.n_users)
    C = float(cfg.clipping.C)
    scale = 0.5 if variant == "noise_halved" else float(a.noise_scale)
    dtype = getattr(torch, cfg.compute.dtype)
    first, second = (clipped_sum(variant, cfg, seqs, rows, dtype) for rows in (D, D_))
    diff = first - second  # the canary's clipped gradient c g (the others' terms cancel)
    norm = float(diff.norm())
    u = diff / norm
    runs, chunk, seed = int(a.runs), int(cfg.compute.chunk_trials), int(cfg.seed)
    log.info("audit: seqrec %s:%s, canary's clipped norm %.4g (C = %g), %d runs per batch", cfg.clipping.name,
             variant, norm, C, runs)
    s_first, s_second = (releases(S, u, std=scale * sigma * C, runs=runs, chunk=chunk, seed=seed,
                                  stream=f"audit-seqrec:{variant}:{side}")
                         for S, side in ((first, "canary"), (second, "neighbour")))
    bound = bounds.eps_lower_bound(s_first, s_second, delta=delta, confidence=float(a.confidence),
                                  select_fraction=float(a.select_fraction))
    power = bounds.eps_power(bound.held_out, float(a.power_factor) * eps, delta=delta, confidence=float(a.confidence))
    # the eps this step really has: a Gaussian mechanism with sensitivity ||c g|| and std scale sigma C
    true_eps = privacy.spent_epsilon(multiplier=scale * sigma * C / norm, T=1, delta=delta)
    row = {"method": f"{cfg.clipping.name}:{variant}", "variant": variant, "eps": eps, "delta": delta, "runs": runs,
           "noise_scale": scale, "sigma": sigma, "sigma_from": str(a.seqrec.sigma), "C": C, "users": D_.shape[0], "parameters": first.numel(),
           "canary_norm": norm, "eps_true": true_eps, **asdict(bound), "eps_power": power,
           "verdict": bounds.verdict(bound, eps, power)}
    return row, s_first, s_second, bound


def audit_variant(variant: str, cfg: DictConfig, seqs, D: torch.Tensor, D_: torch.Tensor, item: int, out) -> dict:
    """``measure`` as one MLflow run (tag kind=audit): parameters, bound, verdict, histogram."""
    a = cfg.audit
    name = f"{cfg.clipping.name}:{variant}"
    tags = {"kind": "audit", "task": "seqrec", "method": name, "variant": variant, "model": cfg.model.name,
            "clipping": cfg.clipping.name}
    with tracking.run(f"audit seqrec {name}", tags):
        row, s_first, s_second, bound = measure(variant, cfg, seqs, D, D_)
        row["canary_item"] = item
        tracking.log_params("audit", {k: v for k, v in row.items()
                                      if k not in ("eps_lower", "eps_estimate", "eps_ceiling", "eps_power", "tpr", "fpr",
                                                   "canary_norm", "eps_true")}
                            | {"confidence": a.confidence, "select_fraction": a.select_fraction})
        tracking.log_params("train", {"model": cfg.model.name, "clipping": cfg.clipping.name, "rule": cfg.clipping.rule,
                                      "dataset": cfg.dataset.name, "L": seqs.L})
        tracking.log_metrics("audit", {"eps_lower": bound.eps_lower, "eps_estimate": min(bound.eps_estimate, 1e6),
                                       "tpr": bound.tpr, "fpr": bound.fpr, "claimed_eps": row["eps"],
                                       "eps_ceiling": bound.eps_ceiling, "eps_power": row["eps_power"],
                                       "canary_norm": row["canary_norm"], "eps_true": row["eps_true"]})
        tracking.set_tag("verdict", row["verdict"])
        held = slice(int(round(a.select_fraction * row["runs"])), None)
        fig = plot.audit_histogram(s_first[held], s_second[held], bound, row, out / f"audit_seqrec_{variant}.png")
        tracking.log_artifacts(fig)
    log.info("audit seqrec %s: eps >= %.3g at %.0f%% confidence (claimed %g; canary's clipped norm %.3g C): %s", name,
             bound.eps_lower, 100 * a.confidence, row["eps"], row["canary_norm"] / row["C"], row["verdict"].upper())
    return row


def run(cfg: DictConfig) -> pd.DataFrame:
    variants = validate(cfg)  # before anything is created or computed
    if cfg.compute.threads:
        torch.set_num_threads(int(cfg.compute.threads))
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), int(cfg.seed))
    users = min(int(cfg.audit.seqrec.users or cfg.seqrec.batch_size), seqs.n_users)
    D, D_, item = batches(seqs, users)
    out = tracking.output_dir()
    out.mkdir(parents=True, exist_ok=True)
    tracking.setup(cfg)
    table = pd.DataFrame([audit_variant(v, cfg, seqs, D, D_, item, out)
                          for v in progress.steps("audit", variants, unit="variant")])
    table.to_csv(out / "audit.csv", index=False)
    shown = table[["method", "eps", "delta", "noise_scale", "runs", "canary_norm", "eps_true", "eps_lower",
                   "eps_ceiling", "eps_power", "verdict"]]
    log.info("seqrec audit of one DP-SGD step at %.0f%% confidence (sigma %.4g, C %g, %d users + canary):\n%s\nwrote %s",
             100 * cfg.audit.confidence, table["sigma"].iloc[0], float(cfg.clipping.C), users,
             shown.to_string(index=False, float_format=lambda x: f"{x:.4g}"), out / "audit.csv")
    return table

