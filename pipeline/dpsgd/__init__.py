"""DP-SGD once, for every task and for people outside the pipeline (shared machinery: it imports
no task). The public door is ``DPSGD`` (``docs/dpsgd.md``; ``examples/dpsgd_gpt2.py`` trains a
Hugging Face GPT-2 with it):

    from pipeline.dpsgd import DPSGD

    dp = DPSGD(model, data, loss_fn, eps=8.0, delta=1e-5, batch_size=64, epochs=3, max_physical_batch=16)
    dp.fit()
    print(dp.eps_spent())

The rooms: ``planning.py`` (noise multiplier from eps, delta, q and steps by the project's
accountants; the eps spent; ``check``, every task's refusal of a budget it cannot reach),
``sampler.py`` (Poisson sampling, physical micro-batches), ``noise.py`` (the clipped sum over
micro-batches, the Gaussian mechanism once per logical step, the scaling), ``trainer.py`` (the loop:
sampling, engine, noise, optimizer, canary hook, divergence checks, checkpoint state), ``api.py``
(``DPSGD``). Names are loaded at first use: a task's validation reads ``planning`` without torch.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "DPSGD": "api",
    "Plan": "planning", "plan": "planning", "check": "planning", "Unreachable": "planning", "ACCOUNTANTS": "planning",
    "PoissonSampler": "sampler", "chunks": "sampler",
    "add_noise": "noise", "clipped_sum": "noise", "noisy_gradient": "noise",
    "Trainer": "trainer", "NonPrivate": "trainer", "Epoch": "trainer", "Diverged": "trainer", "ADAM_BETAS": "trainer",
    "adam": "trainer", "schedule": "trainer", "finite_step": "trainer",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"pipeline.dpsgd.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'pipeline.dpsgd' has no attribute {name!r}")
