"""DP-SGD on a Hugging Face GPT-2 (tied input and output embeddings) at a target eps, in a few lines:
``python examples/dpsgd_gpt2.py`` from the repository root (transformers is a dependency of the
project, ``pip install -e ".[dev]"``; nothing is downloaded: the model is built from a config with
random weights, the data are random token sequences).

``pipeline.dpsgd.DPSGD`` does the rest: the noise multiplier for (eps, delta) from the project's
accountant, Poisson sampling, physical micro-batches of at most ``max_physical_batch`` examples,
Phantom Clipping (exact per-example norms with the tied table), the noise once per logical step,
Adam, a checkpoint to resume from, and the eps spent so far (``docs/dpsgd.md``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from pipeline.dpsgd import DPSGD  # noqa: E402


def loss_fn(model, ids: torch.Tensor) -> torch.Tensor:
    """Each example's next-token loss, (n,). Positions are given per example: (n, T), not (1, T)."""
    n, T = ids.shape
    logits = model(input_ids=ids, position_ids=torch.arange(T, device=ids.device).expand(n, T)).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(1)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1000, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=256, help="the private data set: this many sequences")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--eps", type=float, default=8.0)
    args = parser.parse_args(argv)
    data = torch.randint(0, 1000, (args.examples, 16), generator=torch.Generator().manual_seed(1))
    settings = dict(eps=args.eps, delta=1e-5, batch_size=args.examples // 4, epochs=args.epochs, C=1.0, lr=1e-3,
                    max_physical_batch=8, seed=0)

    model = gpt2()
    dp = DPSGD(model, data, loss_fn, **settings)               # the plan: sigma for eps, q, steps
    print(f"noise multiplier {dp.plan.sigma:.3f} for eps = {args.eps:g}, delta = 1e-5: {dp.plan.steps} steps at "
          f"q = {dp.plan.sample_rate:.3g}; ties found: {dp.trainer.engine.ties()}")
    with tempfile.TemporaryDirectory() as tmp:
        first = dp.epoch()                                       # one epoch of logical steps, in chunks of 8
        dp.save(Path(tmp) / "ckpt.pt")                           # model, optimizer, streams, accountant
        print(f"epoch 1: loss {first.loss:.3f}, eps spent so far {dp.eps_spent():.3f}")
        rest = dp.fit(log_every=None)                            # the epochs the plan has left (silent: we print)
        print(f"epoch {args.epochs}: loss {rest[-1].loss:.3f}, eps spent {dp.eps_spent():.3f} at delta = 1e-5")

        again = gpt2()                                           # a new process would do this: same settings,
        resumed = DPSGD(again, data, loss_fn, **settings).load(Path(tmp) / "ckpt.pt")  # then load
        resumed.fit(log_every=None)
    equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    print(f"resumed from epoch 1's checkpoint: the same weights as the uninterrupted run: {equal}")
    return {"ties": dp.trainer.engine.ties(), "steps": dp.steps_done, "eps_spent": dp.eps_spent(),
            "final_loss": rest[-1].loss, "resumed_equal": equal}


if __name__ == "__main__":
    main()
