"""What one step dispatches: the operators (on a GPU, each one a kernel launch) and the host
synchronisations, of the non-private step and of Phantom Clipping's, counted on the CPU.

    python -m benchmarks.step_ops                     # DPFormer's Amazon shape and GPT-2 small's
    python -m benchmarks.step_ops --shapes amazon --json ops.json

Small steps on a GPU are bound by launches and by the host waiting for the device, not by arithmetic:
every extra small operation costs microseconds a 5 ms step cannot hide, and a synchronisation
(``.item()``, ``bool(t)``, a shape that depends on values, such as ``nonzero``) stalls the queue. The
count is taken with a ``TorchDispatchMode`` around one step after a warm-up: every ATen operator the
step dispatches, forward and backward, less those that only make a view or an empty tensor (no
kernel). Synchronisations: ``_local_scalar_dense`` (``item``, ``float``, ``bool`` of a tensor) and
operators whose output shape depends on values (``nonzero``, ``masked_select``, ``unique``).

Shapes: ``amazon``, DPFormer's tied next-item Transformer at the Amazon Games scale (L = 50,
M = 23,715 items, d = 64, two blocks, B = 64: ``benchmarks/seqrec_step.py``'s model); ``gpt2-small``,
Hugging Face's GPT-2 small (d = 768, 12 layers, T = 256, V = 50,257, tied), B = 2. The steps: the
non-private one (the summed loss's backward) and ``PhantomClipping.step`` (norms, clipped sum by
book-keeping, the guard). Targets (issue 62): Phantom at most 1.5x the non-private operators, no
synchronisation; ``tests/test_step_ops.py`` holds both on small models of the same structure.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

# Operators that make a view, an alias or an uninitialised tensor: no kernel runs.
NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "expand", "as_strided", "detach", "alias", "slice", "select",
             "unsqueeze", "squeeze", "permute", "_reshape_alias", "empty", "empty_strided", "empty_like",
             "lift_fresh", "split", "unbind", "split_with_sizes", "new_empty", "new_empty_strided", "view_as",
             "_local_scalar_dense", "unflatten", "flatten", "reshape", "narrow", "diagonal", "real", "_conj",
             "resolve_conj", "resolve_neg", "set_", "resize_", "squeeze_", "unsqueeze_", "as_strided_"}
SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
         "unique_dim", "nonzero_static", "repeat_interleave"}
SHAPES = ("amazon", "gpt2-small")


def count(step) -> Counter:
    """Every ATen operator one call of ``step`` dispatches, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Counting() as mode:
        step()
    return mode.seen


def launches(seen: Counter) -> int:
    return sum(k for name, k in seen.items() if name not in NO_KERNEL)


def syncs(seen: Counter) -> int:
    return sum(k for name, k in seen.items() if name in SYNCS)


def amazon(B: int = 64, L: int = 50, M: int = 23715, d: int = 64, blocks: int = 2):
    """DPFormer's tied Transformer (``benchmarks/seqrec_step.py``'s worker model): (model, loss_fn, batch)."""
    import torch
    from omegaconf import OmegaConf

    from pipeline.seqrec import clipping, train

    mcfg = OmegaConf.create(dict(arch="transformer", tied=True, d=d, heads=1, blocks=blocks, d_ff=4 * d, layers=1,
                                 dropout=0.2, init_std=0.02))
    model = train.build(mcfg, M, L)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(1, M + 1, (B, L + 1), generator=gen)
    rows[torch.rand(B, generator=gen) < 0.5, : L // 2] = 0  # half the users left-padded
    return model, clipping.user_losses, (rows[:, :-1], rows[:, 1:])


def gpt2(B: int = 2, T: int = 256, V: int = 50257, d: int = 768, layers: int = 12, heads: int = 12):
    """Hugging Face's GPT-2 (tied ``lm_head``) from a config, random weights: (model, loss_fn, batch)."""
    import torch
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=V, n_positions=T, n_embd=d, n_layer=layers, n_head=heads, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)

    def loss_fn(m, ids):
        logits = m(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(1)

    return model, loss_fn, torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))


def measure(model, loss_fn, batch) -> list[dict]:
    """The non-private step and Phantom's, each counted on its second call (the first warms up)."""
    from pipeline.clipping import PhantomClipping

    def plain():
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).sum().backward()

    engine = PhantomClipping(model, C=1.0, stack=True)  # a GPU step's batched products (stack=None: on CUDA only)
    rows = []
    for name, step in (("non-private", plain), ("phantom", lambda: engine.step(loss_fn, batch))):
        step()
        seen = count(step)
        rows.append({"step": name, "launches": launches(seen), "syncs": syncs(seen),
                     "top": dict(Counter({k: v for k, v in seen.items() if k not in NO_KERNEL}).most_common(8))})
    rows[1]["ratio"] = rows[1]["launches"] / rows[0]["launches"]
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    import torch

    torch.manual_seed(0)
    found = []
    print(f"{'shape':<11} {'step':<12} {'launches':>9} {'x':>6} {'syncs':>6}  most dispatched")
    for shape in args.shapes:
        model, loss_fn, batch = amazon() if shape == "amazon" else gpt2()
        for row in measure(model, loss_fn, batch):
            row["shape"] = shape
            found.append(row)
            ratio = f"{row['ratio']:.2f}x" if "ratio" in row else "1.00x"
            top = ", ".join(f"{k} {v}" for k, v in row["top"].items())
            print(f"{shape:<11} {row['step']:<12} {row['launches']:>9} {ratio:>6} {row['syncs']:>6}  {top}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))
    return found


if __name__ == "__main__":
    main()
