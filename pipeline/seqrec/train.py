"""The train step: DP-SGD (Eq. 3.1) over users, the privacy unit, on the shared trainer
(``pipeline/dpsgd/``: plan, Poisson sampling, micro-batches, noise, checkpoint state).

Each step draws a Poisson sample of users (each independently with probability q = B / n_users,
as the accountant assumes), has the clipping engine leave sum_i c_i g_i in ``p.grad`` (c_i: the
automatic or classic clipping coefficient, ||c_i g_i|| <= C), adds Gaussian noise of std
sigma C to every coordinate, divides by the expected batch size B, and takes an Adam step (weight
decay 1e-5; learning rate warmed up linearly over the first 20% of the steps, then decayed linearly
to 0). sigma comes from Opacus's accountant for (eps, delta), q and the number of steps
(``pipeline/privacy.py``); the run logs the eps that accountant gives for the noise it used.

Non-private training: ``clipping=none`` (plain sum, no noise) or ``privacy.eps=inf`` (the chosen
clipping, no noise). ``seqrec.max_physical_batch`` runs each logical batch in chunks of at most that
many users (the same clipped sum, noise and update; null: one piece).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf

from pipeline import dpsgd, privacy, progress
from pipeline.seqrec import checkpoint as checkpoints
from pipeline.seqrec import clipping, models, reattention

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan(dpsgd.Plan):
    """The numbers a run is calibrated with (``pipeline.dpsgd.Plan``), and Re-Attention's."""

    presence_multiplier: float = 0.0  # model=dpformer, presence=private: the item histogram's noise multiplier

    def as_params(self) -> dict:
        return {"n_users": self.n, "batch_size": self.batch_size, "sample_rate": self.sample_rate,
                "steps_per_epoch": self.steps_per_epoch, "steps": self.steps, "sigma": self.sigma,
                "eps_spent": self.eps_spent, "delta": self.delta, "private": self.private,
                "presence_multiplier": self.presence_multiplier}


ADAM_BETAS = dpsgd.ADAM_BETAS  # Adam's moment decays: torch's defaults (the paper, following SASRec, gives none)
Diverged = dpsgd.Diverged  # a non-finite loss, gradient or parameter: the run ends FAILED
schedule = dpsgd.schedule


def model_name(cfg, ablations: bool = True) -> str:
    """The model's name in results, tables, run names and metric keys: ``model.name``, with each
    Re-Attention setting that departs from the defaults after a colon (``dpformer:presence-public``,
    ``dpformer:form-off``, ``dpformer:blocks-2``, ``dpformer:form-paper:blocks-1_2``: characters
    MLflow accepts in a metric name), so that a sweep over ablations keeps them apart and a table
    says which privacy assumption a row made. ``ablations=False``: the name of the model an ablation
    ablates (its presence only: ``dpformer:presence-public`` for ``dpformer:presence-public:form-off``)."""
    re = cfg.get("reattention")
    if re is None:
        return str(cfg.name)
    parts = [str(cfg.name)]
    adam = re.get("errors", "paper") == "adam"
    if re.get("presence", "private") != "private" and not (adam and ablations):  # errors=adam uses no item presence
        parts.append(f"presence-{re.presence}")
    if not ablations:
        return ":".join(parts)
    if re.get("form", "propagated") != "propagated":
        parts.append(f"form-{re.form}")
    if adam:
        parts.append("errors-adam")
    if re.get("blocks") is not None:
        parts.append("blocks-" + "_".join(str(b) for b in re.blocks))
    return ":".join(parts)


def uncorrected(name: str) -> bool:
    """Whether the model named ``name`` (a ``model_name``) runs Re-Attention with its correction
    off (``form-off``): an ablation's control, the same model and streams without the correction."""
    return "form-off" in str(name).split(":")


def build(cfg, n_items: int, max_len: int) -> models.SeqModel:
    """The model ``cfg`` (a ``conf/seqrec/model/*.yaml``) names, for M = n_items and inputs of length max_len."""
    common = dict(dropout=float(cfg.dropout), tied=bool(cfg.tied), init_std=float(cfg.init_std))
    d = int(cfg.d)
    if cfg.arch == "transformer":
        shape = dict(d=d, heads=int(cfg.heads), blocks=int(cfg.blocks), d_ff=int(cfg.d_ff), **common)
        re = cfg.get("reattention")
        if re is not None:  # model=dpformer
            blocks = re.get("blocks")
            return reattention.DPFormer(n_items, max_len, form=str(re.get("form", "propagated")),
                                        corrected=None if blocks is None else list(blocks),
                                        draws=int(re.get("draws", 64)), **shape)
        return models.Transformer(n_items, max_len, **shape)
    if cfg.arch in ("gru", "lstm"):
        return models.Recurrent(n_items, max_len, cell=cfg.arch, d=d, layers=int(cfg.layers), **common)
    raise ValueError(f"unknown model.arch {cfg.arch!r}")


def plan(cfg, n_users: int) -> Plan:
    """Sample rate, steps and the calibrated noise multiplier of the run ``cfg`` describes
    (``pipeline.dpsgd.plan``; Re-Attention's private item histogram takes its share of (eps, delta)
    first, by basic composition, with the analytic Gaussian mechanism)."""
    train = cfg.seqrec
    eps, delta = float(cfg.privacy.eps), float(cfg.privacy.delta)
    private = cfg.clipping.name != "none"
    share = reattention.histogram_share(OmegaConf.select(cfg, "model.reattention"))
    z_hist = 0.0
    if private and math.isfinite(eps) and share:
        z_hist = privacy.gaussian_multiplier(eps=share * eps, delta=share * delta)
    found = dpsgd.plan(n=n_users, batch_size=int(train.batch_size), epochs=int(train.epochs), eps=eps, delta=delta,
                       private=private, accountant=str(train.accountant), share=share if private else 0.0)
    return Plan(**dataclasses.asdict(found), presence_multiplier=z_hist)




def dp_gradient(bound, model, ids, targets, *, sigma: float, C: float, expected_batch: int,
                generator: torch.Generator | None, canaries=None):
    """One DP-SGD gradient of the users (ids, targets), as the training takes it
    (``pipeline.dpsgd.noisy_gradient`` with the task's loss, in one piece), left in ``p.grad``:
    for the step audit, the benchmark and the tests, which hold a batch rather than a run."""
    params = [p for p in model.parameters() if p.requires_grad]
    batches = [(ids, targets)] if ids.shape[0] else []
    return dpsgd.noisy_gradient(bound.engine, clipping.user_losses, batches, params, sigma=sigma, C=C,
                                expected_batch=expected_batch, generator=generator, canaries=canaries)


def adam_errors(cfg, run_plan: Plan) -> np.ndarray:
    """The std DP noise leaves in each parameter after each Adam step of the run (``reattention.adam_errors``
    at this run's learning-rate schedule and ``ADAM_BETAS``): (steps,)."""
    factor = schedule(run_plan.steps, float(cfg.seqrec.warmup))
    lrs = [float(cfg.seqrec.lr) * factor(s) for s in range(run_plan.steps)]
    return reattention.adam_errors(lrs, ADAM_BETAS[0])


@dataclass
class History:
    epoch: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    mean_norm: list[float] = field(default_factory=list)
    valid: list[dict] = field(default_factory=list)  # {epoch, NDCG@k, HIT@k}
    resumed_from: int = 0  # the epoch of the checkpoint this launch continued from (0: none)

    def metrics(self):
        """(epoch, metrics) as ``run`` hands them to ``on_epoch``: the loss, the mean gradient norm
        (private runs) and the validation metrics of the epochs that were evaluated."""
        valid = {v["epoch"]: v for v in self.valid}
        for epoch, loss, norm in zip(self.epoch, self.loss, self.mean_norm):
            out = {"loss": loss} | ({"mean_grad_norm": norm} if norm == norm else {})
            out |= {f"valid_{k}": v for k, v in valid.get(epoch, {}).items() if k != "epoch"}
            yield epoch, out

    def frame(self) -> pd.DataFrame:
        """One row per epoch: loss, mean_norm and the validation metrics (NaN where not evaluated)."""
        df = pd.DataFrame({"epoch": self.epoch, "loss": self.loss, "mean_norm": self.mean_norm})
        if self.valid:
            df = df.merge(pd.DataFrame(self.valid), on="epoch", how="left")
        return df


def run(seqs, cfg, run_plan: Plan, on_epoch: Callable[[int, dict], None] | None = None,
        validate: Callable[[torch.nn.Module], dict] | None = None, device: torch.device | str = "cpu",
        checkpoint: Path | None = None, resume: bool = False, digest: str = "",
        canaries: Callable | None = None, engine: Callable | None = None):
    """Train the configured model on ``seqs.train`` with the shared trainer (``pipeline.dpsgd.Trainer``);
    return (model, History). The model, the training rows, the Poisson sampling and the noise live on
    ``device`` (one generator there, seeded as on the CPU, draws both the samples and the noise: a CPU
    run's numbers do not depend on this argument). With ``checkpoint`` (a path), the state is saved
    there at the end of every epoch; with ``resume``, a checkpoint there of the same config
    (``digest``) is continued from (``pipeline/seqrec/checkpoint.py``).

    For the whole-run audit (``pipeline/seqrec/audit_run.py``): ``canaries(model)`` makes the run's
    Dirac canaries (``pipeline.audit.canaries.DiracCanaries``; the caller keeps what it made), which join
    every step and are checkpointed with the run, and ``engine(model)`` replaces the configured
    clipping engine (a negative control's test double)."""
    train = cfg.seqrec
    device = torch.device(device)
    torch.manual_seed(int(cfg.seed))
    model = build(cfg.model, seqs.n_items, seqs.L).to(device)
    dirac = canaries(model) if canaries is not None else None
    bound = clipping.make(cfg.clipping.name, model, cfg.clipping) if engine is None else engine(model)
    opt, sched = dpsgd.adam(model, lr=float(train.lr), weight_decay=float(train.weight_decay), steps=run_plan.steps,
                            warmup=float(train.warmup))
    adam_errs = None  # model.reattention.errors=adam: the error after each step (reattention.adam_errors)
    re = cfg.model.get("reattention")
    if re is not None and re.get("errors", "paper") == "adam":
        if run_plan.sigma > 0:
            adam_errs = adam_errors(cfg, run_plan)
    elif re is not None:  # model=dpformer: Re-Attention's effective errors (the paper's)
        reattention.calibrate(model, seqs.train, sigma_dp=run_plan.sigma, C=float(cfg.clipping.C),
                              batch_size=run_plan.batch_size, presence_multiplier=run_plan.presence_multiplier,
                              generator=torch.Generator().manual_seed(int(cfg.seed) + 2))
    sampled = isinstance(model, reattention.DPFormer) and model.form == "sampled"
    gen = torch.Generator(device=device).manual_seed(int(cfg.seed) + 1)  # Poisson sampling and noise
    rows = seqs.train.to(device)

    def take(pick: torch.Tensor):
        batch = rows[pick]
        return batch[:, :-1], batch[:, 1:]

    trainer = dpsgd.Trainer(model, bound.engine, clipping.user_losses, take, run_plan, C=float(cfg.clipping.C),
                            optimizer=opt, schedule=sched, sampling=gen, canaries=dirac,
                            max_physical_batch=train.get("max_physical_batch"),
                            hint=f"seqrec.lr = {train.lr}, clipping.C = {cfg.clipping.C}")
    history = History()
    first = 1
    key = checkpoints.key(digest, device, seqs)
    state = checkpoints.load(checkpoint, key) if resume else None
    if state is not None:
        trainer.load_state_dict(state["dpsgd"], where=str(checkpoint))
        history = History(**state["history"] | {"resumed_from": int(state["epoch"])})
        first = int(state["epoch"]) + 1
        log.info("resume: %s holds epoch %d of %d; continuing from epoch %d", checkpoint, state["epoch"],
                 int(train.epochs), first)
        if on_epoch is not None:  # the restored epochs' metrics, for this run's record
            for epoch, metrics in history.metrics():
                on_epoch(epoch, metrics)
    epochs = int(train.epochs)
    bar = progress.Progress("train", total=epochs - first + 1, unit="epoch")  # a line per epoch, with a rate and what is left

    def before_step(done: int) -> None:  # done: the steps taken before this one
        bar.note(f"epoch {done // run_plan.steps_per_epoch + 1}/{epochs}, step {done + 1}/{run_plan.steps}")
        if adam_errs is not None:  # the noise the present parameters carry: e_(t-1), 0 before the first step
            model.set_uniform_errors(adam_errs[done - 1] if done else 0.0)
        if sampled:  # model.reattention.form=sampled: this step's draws
            model.at_step(done)

    for epoch in range(first, int(train.epochs) + 1):
        model.train()
        bar.start(f"epoch {epoch}/{epochs}")
        found = trainer.epoch(before_step)
        if adam_errs is not None:  # validation and, after the last epoch, evaluation: e_t after this epoch
            model.set_uniform_errors(adam_errs[epoch * run_plan.steps_per_epoch - 1])
        if sampled:  # validation's draws: those of the step after the epoch's last
            model.at_step(epoch * run_plan.steps_per_epoch)
        trainer.check_parameters(epoch)
        history.epoch.append(epoch)
        history.loss.append(found.loss)
        history.mean_norm.append(found.mean_norm)
        metrics = {"loss": history.loss[-1]}
        if trainer.private:
            metrics["mean_grad_norm"] = history.mean_norm[-1]
        if validate is not None and (epoch % int(train.eval_every) == 0 or epoch == int(train.epochs)):
            checked = validate(model)
            history.valid.append({"epoch": epoch, **checked})
            metrics.update({f"valid_{k}": v for k, v in checked.items()})
        if checkpoint is not None:
            checkpoints.save(checkpoint, key=key, epoch=epoch, trainer=trainer, history=history)
        if on_epoch is not None:
            on_epoch(epoch, metrics)
    bar.close()
    if adam_errs is not None:  # also when a resumed run found every epoch done (its buffers are not checkpointed)
        model.set_uniform_errors(adam_errs[-1])
    if sampled:  # evaluation's draws (also after a resume that found every epoch done)
        model.at_step(run_plan.steps)
    return model, history
