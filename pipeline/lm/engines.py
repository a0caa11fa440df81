"""The clipping engines of the language-model task: each leaves the clipped sum sum_i c_i g_i of
the sampled posts' gradients in ``p.grad`` (c_i = min(1, C / ||g_i||), so ||c_i g_i|| <= C) and
returns the per-post losses and gradient norms. Noise is added by the shared trainer
(``pipeline.dpsgd.add_noise``), the same draw whatever the engine.

- ``phantom``: the shared engine (``pipeline.clipping.PhantomClipping``), tied or untied, exact,
  without per-post gradients;
- ``per_sample``: Opacus's hooks mode (``pipeline.clipping.opacus.PerSample``; functorch for
  Hugging Face's Conv1D), every post's gradient instantiated (B x V x d floats for the table): the
  reference;
- ``ghost``: Opacus's fast gradient clipping (``pipeline.clipping.opacus.Ghost``), untied models
  only (it refuses a parameter used twice: refused here by name, before any compute);
- ``none``: the plain sum, no clipping (the non-private baseline, ``pipeline.dpsgd.NonPrivate``).
"""

from __future__ import annotations

ENGINES = ("phantom", "per_sample", "ghost", "none")


def refusal(name: str, model) -> str | None:
    """Why ``name`` cannot run ``model`` (None if it can)."""
    from pipeline.clipping.opacus import shared_parameters

    if name not in ENGINES:
        return f"clipping {name!r} is unknown; known: {list(ENGINES)}"
    if name in ("per_sample", "ghost") and hasattr(model, "token_losses"):
        return (f"clipping={name} cannot clip a model whose output layer is read in chunks (model.chunked_head): "
                "Opacus forms the logits' per-post gradients; use clipping=phantom, or model.chunked_head=0")
    if name == "ghost" and shared_parameters(model):
        return ("clipping=ghost cannot clip a tied model: Opacus's ghost clipping refuses a parameter used "
                "twice (the tied table); use clipping=phantom, or an untied model")
    return None


class Bound:
    """A shared engine (``pipeline.clipping``, or ``pipeline.dpsgd.NonPrivate``) with the task's per-post
    loss bound in; the trainer takes its ``engine`` with ``examples.example_losses``."""

    def __init__(self, engine):
        self.engine = engine
        self.private = bool(getattr(engine, "private", True))

    def step(self, batch):
        from pipeline.lm.examples import example_losses

        return self.engine.step(example_losses, batch)


def make(name: str, model, C: float):
    """The engine ``name`` on ``model``; ValueError with ``refusal``'s reason where it cannot run it."""
    why = refusal(name, model)
    if why is not None:
        raise ValueError(why)
    if name == "none":
        from pipeline.dpsgd import NonPrivate

        return Bound(NonPrivate(model))
    from pipeline.clipping import PhantomClipping, opacus

    return Bound({"phantom": PhantomClipping, "per_sample": opacus.PerSample, "ghost": opacus.Ghost}[name](model, C))
