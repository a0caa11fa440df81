"""The clipping engines of the language-model task: each leaves the clipped sum sum_i c_i g_i of
the sampled posts' gradients in ``p.grad`` (c_i = min(1, C / ||g_i||), so ||c_i g_i|| <= C) and
returns the per-post losses and gradient norms. Noise is added by the training step
(``train.add_noise``), the same draw whatever the engine.

- ``phantom``: the shared engine (``pipeline.clipping.PhantomClipping``), tied or untied, exact,
  without per-post gradients;
- ``per_sample``: Opacus's hooks mode (``GradSampleModule``; functorch for Hugging Face's Conv1D),
  every post's gradient instantiated (B x V x d floats for the table): the reference;
- ``ghost``: Opacus's fast gradient clipping, untied models only (it refuses a parameter used
  twice: refused here by name, before any compute);
- ``none``: the plain sum, no clipping (the non-private baseline).
"""

from __future__ import annotations

import warnings

import torch

from pipeline.lm.examples import example_losses

ENGINES = ("phantom", "per_sample", "ghost", "none")
EPS_NORM = 1e-6  # c_i = min(1, C / (||g_i|| + EPS_NORM)), Opacus's and the shared engine's


def tied(model) -> bool:
    return model.lm_head.weight is model.transformer.wte.weight


def refusal(name: str, model) -> str | None:
    """Why ``name`` cannot run ``model`` (None if it can)."""
    if name not in ENGINES:
        return f"clipping {name!r} is unknown; known: {list(ENGINES)}"
    if name == "ghost" and tied(model):
        return ("clipping=ghost cannot clip a tied model: Opacus's ghost clipping refuses a parameter used "
                "twice (the tied table); use clipping=phantom, or an untied model")
    return None


class Phantom:
    private = True

    def __init__(self, model, C: float):
        from pipeline.clipping import PhantomClipping

        self.engine = PhantomClipping(model, C=C)

    def step(self, batch):
        return self.engine.step(example_losses, batch)


class PerSample:
    private = True

    def __init__(self, model, C: float):
        from opacus import GradSampleModule

        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.model, self.C = model, C
        self.gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, batch):
        self.gsm.zero_grad(set_to_none=True)
        losses = example_losses(self.gsm, batch)
        losses.sum().backward()
        grads = [p.grad_sample for p in self.params]
        norms = torch.stack([g.flatten(1).square().sum(1) for g in grads]).sum(0).sqrt()
        c = (self.C / (norms + EPS_NORM)).clamp(max=1.0)
        for p, g in zip(self.params, grads):
            p.grad = torch.einsum("n,n...->...", c, g)
            p.grad_sample = None
        return losses.detach(), norms.detach()


class Ghost:
    private = True

    def __init__(self, model, C: float):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.C = C
        self.gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="sum",
                                                        max_grad_norm=C, use_ghost_clipping=True)

    def step(self, batch):
        self.gsm.zero_grad(set_to_none=True)
        losses = example_losses(self.gsm, batch)
        losses.sum().backward(retain_graph=True)
        norms = self.gsm.get_norm_sample().detach()
        c = (self.C / (norms + EPS_NORM)).clamp(max=1.0)
        self.gsm.zero_grad(set_to_none=True)
        self.gsm.disable_hooks()
        try:
            (c * losses).sum().backward()
        finally:
            self.gsm.enable_hooks()
        return losses.detach(), norms


class NonPrivate:
    private = False

    def __init__(self, model, C: float):
        self.model = model

    def step(self, batch):
        self.model.zero_grad(set_to_none=True)
        losses = example_losses(self.model, batch)
        losses.sum().backward()
        return losses.detach(), None


def make(name: str, model, C: float):
    """The engine ``name`` on ``model``; ValueError with ``refusal``'s reason where it cannot run it."""
    why = refusal(name, model)
    if why is not None:
        raise ValueError(why)
    return {"phantom": Phantom, "per_sample": PerSample, "ghost": Ghost, "none": NonPrivate}[name](model, C)
