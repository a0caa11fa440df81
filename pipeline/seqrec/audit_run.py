"""The whole-run audit of DPFormer's DP-SGD (``python -m pipeline.audit experiment=dpformer_*
audit.scope=run``): one real training run of this task's loop (``train.run``: its Poisson sampling
of users, accountant plan, learning-rate schedule, Adam and checkpointing) with m canaries, scored
after training and bounded against the eps the accountant claims for DP-SGD's share of the budget
(Re-Attention's item histogram has its own share, which canaries in the gradient do not touch).
The variants, the scoring, the power and the record are shared (``pipeline/audit/run.py``); this
module supplies the training and the canaries:

- ``dirac``: white-box canaries (``pipeline.audit.canaries.DiracCanaries``), each a parameter
  coordinate, added to the clipped sum (``pipeline.dpsgd.noisy_gradient``) and scored by its coordinate of
  the sum of the noisy sums;
- ``input``: m canary users, each L + 1 items drawn uniformly (unique content), included in the
  training rows with probability 1/2 and scored by minus their loss under the final model (what an
  attacker of the released model can do). All m rows are in the training tensor; an excluded one
  is all padding, so its loss and gradient are exactly 0 (a user with no item to predict) and the
  clipped sum is the one without it, while the number of users, and with it q = B / n, does not
  depend on the bits. Input canaries are refused for model=dpformer: its item histogram would count
  the canaries' items, a second mechanism the claim audited here leaves out.

Besides the shared controls, ``one_branch`` trains with :class:`pipeline.seqrec.audit.OneBranchPhantom`
(fastDP's tied-embedding bug: the item table's norm from its input branch only, so users' clipped
gradients exceed C). Dirac canaries cannot see it (their gradient joins the sum after clipping, of
norm C by construction); input canaries, whose gradients pass through the engine, can. The
one-step audit (``python -m pipeline.audit experiment=dpformer_ci audit.seqrec.controls=[one_branch]``)
sees it in one step with a worst-case canary user.

``resume_reuses_noise`` stops the run after half its epochs (a checkpoint written, as a killed run
leaves it), puts the run's generator's first state into the checkpoint (Poisson sampling and noise
share that generator here: the resumed epochs replay the first epochs' samples and noise) and
resumes into a fresh model and fresh canaries.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from pipeline import progress
from pipeline.audit import run as run_audit
from pipeline.audit.canaries import DiracCanaries


VARIANTS = run_audit.VARIANTS + ("one_branch",)
UNSEEN_BY_DIRAC = "white-box canaries join the sum after clipping: a clipping defect does not touch them"
SEED_OFFSET = 104729  # the input canaries' own stream (their items and bits)


class _Killed(Exception):
    """Raised after the checkpoint of the epoch at which ``resume_reuses_noise`` stops its run."""


def input_canaries(m: int, *, L: int, n_items: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """(m, L + 1) canary users of items drawn uniformly from 1..M (their own generator) and their
    inclusion bits (secret until scoring): distinct with overwhelming probability, not by construction."""
    g = torch.Generator().manual_seed(seed + SEED_OFFSET)
    rows = torch.randint(1, n_items + 1, (m, L + 1), generator=g)
    return rows, np.random.default_rng(seed + SEED_OFFSET).random(m) < 0.5


def _train(seqs, cfg: DictConfig, used, *, variant: str, dirac_m: int | None, engine) -> tuple:
    """The audited training; returns (model, its Dirac canaries or None). ``resume_reuses_noise`` is
    stopped after half its epochs and resumed, into a fresh model and fresh canaries, from a
    checkpoint whose generator is the run's first state."""
    from pipeline.seqrec import checkpoint as checkpoints
    from pipeline.seqrec import train

    made: list[DiracCanaries] = []

    def canaries(model):
        made.append(DiracCanaries([p for p in model.parameters() if p.requires_grad], m=dirac_m,
                                  C=float(cfg.clipping.C), sample_rate=used.sample_rate, seed=int(cfg.seed)))
        return made[-1]

    kw = dict(canaries=canaries if dirac_m else None, engine=engine)
    if variant != "resume_reuses_noise":
        model, _ = train.run(seqs, cfg, used, **kw)
        return model, made[-1] if made else None
    half = int(cfg.seqrec.epochs) // 2

    def kill(epoch, metrics):
        if epoch == half:
            raise _Killed

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "audit.pt"
        try:
            train.run(seqs, cfg, used, on_epoch=kill, checkpoint=path, digest="audit", **kw)
        except _Killed:
            pass
        key = checkpoints.key("audit", torch.device("cpu"), seqs)
        state = checkpoints.load(path, key)
        state["dpsgd"]["noise"] = torch.Generator().manual_seed(int(cfg.seed) + 1).get_state()  # the defect
        checkpoints.write(path, state)
        model, _ = train.run(seqs, cfg, used, checkpoint=path, resume=True, digest="audit", **kw)
    return model, made[-1] if made else None


def claim(cfg: DictConfig) -> tuple[float, float]:
    """(eps, delta) of DP-SGD's share of ``privacy``: all of it, less Re-Attention's histogram's share."""
    from pipeline.seqrec import reattention

    share = reattention.histogram_share(OmegaConf.select(cfg, "model.reattention"))
    return (1 - share) * float(cfg.privacy.eps), (1 - share) * float(cfg.privacy.delta)


def run(seqs, cfg: DictConfig, *, variant: str, canaries: str = "dirac", m: int = 1000, out: Path | None = None,
        params: dict | None = None) -> dict:
    """One audited training of ``cfg``'s model on ``seqs``: its row (``run_audit.score``). With ``out``,
    it is recorded as an MLflow run with its figure (``run_audit.record``; the caller set the store up)."""
    from pipeline.seqrec import audit as step_audit
    from pipeline.seqrec import models, train

    if canaries not in run_audit.CANARIES:
        raise ValueError(f"unknown canaries {canaries!r}; known: {run_audit.CANARIES}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown audit variant {variant!r}; known: {VARIANTS}")
    if canaries == "input":
        rows, included = input_canaries(m, L=seqs.L, n_items=seqs.n_items, seed=int(cfg.seed))
        kept = torch.where(torch.from_numpy(included)[:, None], rows, torch.zeros_like(rows))  # excluded: padding
        seqs = dataclasses.replace(seqs, train=torch.cat([seqs.train, kept]))
    eps, delta = claim(cfg)
    claimed = train.plan(cfg, seqs.n_users)
    accountant = str(cfg.seqrec.accountant)
    used = run_audit.actual_plan(claimed, "engine" if variant == "one_branch" else variant, eps=eps, delta=delta,
                                 accountant=accountant)
    engine = None
    if variant == "one_branch":  # the step audit's negative control, the same engine in the whole run
        def engine(model):
            return step_audit.engine_for("one_branch", model, cfg)
    model, dirac = _train(seqs, cfg, used, variant=variant, dirac_m=m if canaries == "dirac" else None, engine=engine)
    if dirac is not None:
        scores, bits = dirac.scores(), dirac.reveal()  # the bits are read here, after training, only
    else:
        model.eval()
        with torch.no_grad():
            ids, targets = rows[:, :-1], rows[:, 1:]
            scores = -models.user_losses(model(ids), ids, targets).double().numpy()
        bits = included
    unseen = UNSEEN_BY_DIRAC if variant == "one_branch" and canaries == "dirac" else None
    row = run_audit.score(scores, bits, variant=variant, canaries=canaries, claimed=claimed, used=used,
                          n=seqs.n_users, eps=eps, delta=delta, confidence=float(cfg.audit.confidence),
                          power_factor=float(cfg.audit.power_factor), accountant=accountant, unseen=unseen,
                          white_box=dirac)
    if out is not None:
        run_audit.record(row, scores, bits, task="seqrec", out=out, params=params or {}, white_box=dirac)
    return row


def parse_variants(spec, key: str = "audit.seqrec.run.variants") -> list[tuple[str, str]]:
    """``[engine, no_noise, engine:input]`` -> [(variant, canaries)] (``run_audit.parse_variants``)."""
    return run_audit.parse_variants(spec, key, VARIANTS)


def validate(cfg: DictConfig) -> tuple[dict, list[tuple[str, str]]]:
    """The audit's settings, refused before anything runs: the cell's (``config.validate``), the
    audit's shared keys, the canary counts and the variants; the run must be private."""
    from pipeline import validation
    from pipeline.audit import bounds
    from pipeline.seqrec import config
    from pipeline.validation import ConfigError

    config.validate(cfg)
    validation.threads(cfg.compute.threads, "compute.threads")
    bounds.check_keys(cfg.audit)
    spec = (cfg.audit.get("seqrec") or {}).get("run") or {}
    for key in spec:
        if key not in ("m", "input_m", "variants"):
            raise ConfigError(f"audit.seqrec.run.{key} is not a key of the whole-run audit; its keys: m, input_m, variants")
    m = {"dirac": validation.positive_int(spec.get("m", 1000), "audit.seqrec.run.m"),
         "input": validation.positive_int(spec.get("input_m", 1000), "audit.seqrec.run.input_m")}
    variants = parse_variants(spec.get("variants"))
    if cfg.clipping.name == "none" or not math.isfinite(float(cfg.privacy.eps)):
        raise ConfigError(f"clipping.name = {cfg.clipping.name!r}, privacy.eps = {float(cfg.privacy.eps):g}: the "
                          "whole-run audit audits a private run (a clipping engine and a finite eps)")
    if any(v == "resume_reuses_noise" for v, _ in variants) and int(cfg.seqrec.epochs) < 2:
        raise ConfigError(f"audit.seqrec.run.variants: resume_reuses_noise stops the run after half its epochs; "
                          f"seqrec.epochs = {cfg.seqrec.epochs} has no half (at least 2)")
    if any(v == "one_branch" for v, _ in variants) and not (cfg.clipping.name == "phantom" and cfg.model.tied):
        raise ConfigError(f"audit.seqrec.run.variants: one_branch is a bug of the tied item table under Phantom "
                          f"Clipping; it needs clipping=phantom and a tied model, got clipping={cfg.clipping.name} "
                          f"model={cfg.model.name}")
    if any(k == "input" for _, k in variants) and cfg.model.get("reattention") is not None:
        raise ConfigError(f"audit.seqrec.run.variants: input canaries with model={cfg.model.name}: its private item "
                          "histogram would count the canaries' items, a mechanism this audit's claim leaves out; use "
                          "white-box canaries (no :input) or a model without Re-Attention")
    return m, variants


def from_config(cfg: DictConfig):
    """``python -m pipeline.audit experiment=dpformer_* audit.scope=run``: each variant a real training
    of the preset's model on its data, audited against DP-SGD's share of the budget, each an MLflow
    run (kind=audit, scope=run) with its figure and scores; ``audit.csv``, ``audit.md`` and
    ``metrics.json`` hold every row (in the run's folder, and in ``report.dir`` where set)."""
    from pipeline.seqrec import data, train

    m, variants = validate(cfg)  # before anything is created or computed
    if cfg.seqrec.get("threads"):
        torch.set_num_threads(int(cfg.seqrec.threads))
    seqs = data.load(cfg.dataset, int(cfg.dataset.L), int(cfg.seed))
    coordinates = sum(p.numel() for p in train.build(cfg.model, seqs.n_items, seqs.L).parameters() if p.requires_grad)
    eps, delta = claim(cfg)
    if run_audit.plan_only(cfg, variants, m, coordinates, "audit.seqrec.run.m", claimed=train.plan(cfg, seqs.n_users),
                           eps=eps, delta=delta, accountant=str(cfg.seqrec.accountant)):
        return None  # audit.plan_only: what each bound can reach, printed; nothing trained
    out = run_audit.start(cfg, variants, m["dirac"], coordinates, "audit.seqrec.run.m")
    name = train.model_name(cfg.model)
    params = {"model": name, "clipping": str(cfg.clipping.name), "C": float(cfg.clipping.C), "lr": float(cfg.seqrec.lr),
              "batch_size": int(cfg.seqrec.batch_size), "epochs": int(cfg.seqrec.epochs), "users": seqs.n_users,
              "items": seqs.n_items, "L": seqs.L, "seed": int(cfg.seed), "accountant": str(cfg.seqrec.accountant)}
    rows = []
    with progress.Progress("audit", total=len(variants), unit="training") as bar:  # each variant a whole training
        for variant, kind in variants:
            bar.start(f"{variant}:{kind} (m = {m[kind]})")
            rows.append(run(seqs, cfg, variant=variant, canaries=kind, m=m[kind], out=out / "runs", params=params))
            bar.write(run_audit.line(rows[-1]))
    scale = (f"{name} (d = {cfg.model.d}, {'tied' if cfg.model.tied else 'untied'}), {cfg.clipping.name} clipping, "
             f"{seqs.n_users} users (and the input canaries, where named), {seqs.n_items} items, L = {seqs.L}, "
             f"B = {cfg.seqrec.batch_size}, {cfg.seqrec.epochs} epochs, seed {cfg.seed}")
    return run_audit.publish(rows, out, cfg.get("report", {}).get("dir"), scale=scale, claimed_eps=eps)
