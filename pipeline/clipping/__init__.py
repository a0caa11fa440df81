"""Phantom Clipping for any PyTorch model: exact per-example gradient norms with tied weights, and
the clipped sum of per-example gradients, without per-example gradients (shared machinery: any
task may use it; it imports none).

    from pipeline.clipping import PhantomClipping

    engine = PhantomClipping(model, C=1.0)                 # ties found by identity, unknown layers refused
    losses, norms = engine.step(loss_fn, batch)            # p.grad: sum_i min(1, C / ||g_i||) g_i
    # add the Gaussian noise (std = noise multiplier x C) to every p.grad, then optimizer.step()

``loss_fn(model, batch)`` returns the per-example losses, shape (n,). The runnable example is
``python examples/clipping_gpt2.py`` (a GPT-2 from Hugging Face's transformers, tied input and
output embeddings, checked against one backward pass per example); ``docs/clipping.md`` says what it
computes, what it refuses and how to add a layer type.
"""

from pipeline.clipping.engine import PhantomClipping, Unsupported, coefficients
from pipeline.clipping.layers import LAYERS, register

__all__ = ["PhantomClipping", "Unsupported", "coefficients", "register", "LAYERS"]
