"""Phantom Clipping on a Hugging Face GPT-2 with tied input and output embeddings, in a few lines:
``python examples/clipping_gpt2.py`` from the repository root (transformers is a dependency of the project,
``pip install -e ".[dev]"``; nothing is downloaded, the model is built from a config with random
weights).

It checks the engine's per-example norms against one backward pass per example, then trains a few
DP-SGD steps: Poisson-sampled batches, the clipped sum, Gaussian noise calibrated by the project's
accountant (``pipeline.privacy``), any torch optimizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from pipeline import privacy  # noqa: E402
from pipeline.clipping import PhantomClipping  # noqa: E402


def loss_fn(model, ids: torch.Tensor) -> torch.Tensor:
    """Each example's next-token loss, (n,), from the model's own forward as shipped (its default
    (1, T) position ids are expanded over the batch by the engine)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=64, help="the private data set: this many sequences")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--eps", type=float, default=8.0)
    args = parser.parse_args(argv)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1000, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    data = torch.randint(0, config.vocab_size, (args.examples, 16))

    engine = PhantomClipping(model, C=1.0)                      # 1. wrap the model (ties found, unknown layers refused)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)   # 2. any optimizer
    q, delta = 0.25, 1e-5                                       # 3. calibrate the noise (Poisson rate q, `steps` steps)
    sigma = privacy.dpsgd_noise_multiplier(eps=args.eps, delta=delta, sample_rate=q, steps=args.steps, accountant="prv")
    print(f"ties found: {engine.ties()}; noise multiplier {sigma:.3f} for eps = {args.eps:g}, delta = {delta:g}")

    model.eval()  # no dropout while comparing with the brute force
    losses, norms = engine.per_example_norms(loss_fn, data[:4])
    brute = []
    for i in range(4):
        grads = torch.autograd.grad(loss_fn(model, data[i:i + 1])[0], list(model.parameters()))
        brute.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
    error = float((norms - torch.stack(brute)).abs().max() / torch.stack(brute).max())
    print(f"per-example norms {[round(float(x), 4) for x in norms]}; largest relative difference from one "
          f"backward pass per example: {error:.1e}")

    model.train()
    for step in range(args.steps):
        batch = data[torch.rand(len(data)) < q]                   # 4. a Poisson sample of the examples
        if len(batch) == 0:  # an empty sample still releases a noisy (zero) sum: the accountant counts every step
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            losses, norms = torch.zeros(0), torch.zeros(0)
        else:
            losses, norms = engine.step(loss_fn, batch)           # 5. p.grad = sum_i min(1, C/||g_i||) g_i
        engine.add_noise(sigma)                                   #    + N(0, (sigma C)^2)
        for p in model.parameters():
            p.grad /= q * len(data)                               #    the expected batch size
        optimizer.step()
        print(f"step {step}: {len(batch)} examples, mean loss {float(losses.mean()) if len(losses) else 0:.3f}, "
              f"{int((norms > engine.C).sum())} clipped")
    spent = privacy.dpsgd_spent_epsilon(sigma=sigma, delta=delta, sample_rate=q, steps=args.steps, accountant="prv")
    print(f"spent eps = {spent:.3f} at delta = {delta:g}")
    return {"relative_error": error, "ties": engine.ties(), "spent_eps": spent}


if __name__ == "__main__":
    main()
