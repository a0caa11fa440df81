"""DPFormer's memory model: the bytes of a cell's largest tensors, from the config and the data's
size, checked against the memory of the cell's device before anything is computed
(``pipeline.preflight.memory``: the GPU's free memory on CUDA, MemAvailable on the CPU, times the
cells a joblib sweep runs at once).

The full-softmax scores dominate at a large M: a step holds B' x L x M float32 scores about 3.5
times (the logits, their softmax, its gradient, and temporaries: the CPU step benchmark measured
3.3 to 3.9 copies at M = 23,715; ``tests/test_preflight.py`` checks the bound against measured
steps), B' the expected batch B plus four of its standard deviations (Poisson sampling);
evaluation holds ``seqrec.eval_batch`` x M twice; a Transformer's attention, per block, the users x
heads x L x L logits and weights with their gradients (four copies; what matters at a long L); the
activations autograd keeps for the backward pass, per token of the batch (``ACTIVATIONS``,
measured: what dominates at a small M); the parameters four times (values, gradients, Adam's two
moments), and Opacus's per-sample engine one gradient per user.
The sizes are read before the data are built: the synthetic generator's ``n_users``/``n_items``
(upper bounds), or a file's users and items after its filters."""

from __future__ import annotations

import math

from omegaconf import DictConfig

from pipeline.seqrec import data
from pipeline.task import Memory

FLOAT = 4  # bytes: every training tensor is float32
SCORE_COPIES = 3.5  # B' x L x M float32 tensors a step holds at its peak
ATTENTION_COPIES = 4  # per block: the logits, the weights, their gradients (and the causal mask, a quarter as large)
# The float32 values a training step keeps per token of its batch (besides the scores): a bound fitted to
# peak memory measured by one Phantom step on the CPU (ru_maxrss, B = 512, L = 50, M = 100, 1 thread,
# 2026-11-24), which it exceeds by 1.0x-1.3x: per token 6,111 floats (d = 64, d_ff = 256, 2 blocks),
# 10,693 (4 blocks), 11,552 (d_ff = 1,024), 8,279 (d = 128); a GRU 2,740 (d = 64, 1 layer), 3,808 (2 layers),
# 3,845 (d = 128); an LSTM 2,280. The transformer's counts include its L x L attention, counted again below.
ACTIVATIONS = {"transformer": lambda m: int(m.blocks) * (24 * int(m.d) + 4 * int(m.d_ff)) + 12 * int(m.d),
               "rnn": lambda m: int(m.layers) * 18 * int(m.d) + 20 * int(m.d)}


def sizes(ds: DictConfig) -> tuple[int, int]:
    """(users, items) of the data set, known before it is built: the synthetic generator's
    ``n_users``/``n_items``, or the file's after its filters (``data.interactions``, cached: the
    run reads the same)."""
    if ds.name == "synthetic_longtail":
        return int(ds.n_users), int(ds.n_items)
    users, _, n_items, *_ = data.interactions(ds)
    return int(users.max()) + 1, int(n_items)


def parameters(m: DictConfig, M: int, L: int) -> int:
    d = int(m.d)
    tables = (M + 1) * d + (0 if m.tied else M * d) + L * d  # items with the padding row, an untied output, positions
    if m.arch == "transformer":
        return tables + int(m.blocks) * (4 * d * d + 2 * d * int(m.d_ff) + 9 * d + int(m.d_ff))  # ff1's bias: d_ff
    return tables + int(m.layers) * 4 * 3 * d * d  # a GRU's or LSTM's gates, generously


def estimate(cfg: DictConfig, device: str) -> Memory:
    users, M = sizes(cfg.dataset)
    L = int(cfg.dataset.L)
    B = min(int(cfg.seqrec.batch_size), users)
    batch = min(users, B + math.ceil(4 * math.sqrt(B)))
    n = parameters(cfg.model, M, L)
    transformer = cfg.model.arch == "transformer"
    parts = {
        "batch scores": int(SCORE_COPIES * FLOAT * batch * L * (M + 1)),
        "evaluation scores": 2 * FLOAT * min(int(cfg.seqrec.eval_batch), users) * (M + 1),
        "parameters and Adam": 4 * FLOAT * n,
        "activations": FLOAT * batch * L * ACTIVATIONS["transformer" if transformer else "rnn"](cfg.model),
    }
    if transformer:  # per block, the (users x heads x L x L) logits and weights a step keeps
        rows = max(batch, min(int(cfg.seqrec.eval_batch), users))
        parts["attention"] = ATTENTION_COPIES * FLOAT * rows * int(cfg.model.heads) * L * L * int(cfg.model.blocks)
    re = cfg.model.get("reattention")
    if transformer and re is not None and re.get("form") == "sampled":  # counted, not fitted: the copies' tokens
        # (about 8 d + 2 d_ff floats each a block: q, k, v, merged, residuals, LayerNorms, the feed-forward),
        # per block five (users x heads x L x L) tensors of S draws (logits, weights, the own variances and a
        # draw's deviations and their squares) and three noisy item tables at a time. Checked once (2026-11-27,
        # CPU, B = 256, L = 50, M = 200, d = 64, d_ff = 256, S = 32): a forward and backward pass grew the
        # resident set by 1.75 GiB, this part counts 1.94 GiB
        S, heads, d = int(re.get("draws", 64)), int(cfg.model.heads), int(cfg.model.d)
        parts["Re-Attention's draws"] = FLOAT * (S * rows * L * (8 * d + 2 * int(cfg.model.d_ff) + 5 * heads * L)
                                                 + 3 * (M + 1) * d)
    if cfg.clipping.name == "per_sample":
        parts["per-user gradients"] = FLOAT * batch * n
    largest = max(parts, key=parts.get)
    if largest == "parameters and Adam":
        key, value = ("model.d", cfg.model.d)
        advice = f"lower model.d{', model.d_ff or model.blocks' if transformer else ''} ({n:,} parameters)"
    elif largest == "activations":
        key, value = "seqrec.batch_size", cfg.seqrec.batch_size
        advice = f"lower seqrec.batch_size, dataset.L (= {L}) or the model (model.d, model.d_ff, model.blocks)"
    elif largest == "Re-Attention's draws":
        key, value = "model.reattention.draws", cfg.model.reattention.draws
        advice = "lower model.reattention.draws, seqrec.batch_size or seqrec.eval_batch, or use form=propagated"
    elif largest == "per-user gradients":
        key, value, advice = "clipping.name", cfg.clipping.name, ("use clipping=phantom (no per-user gradients) or "
                                                                  "lower seqrec.batch_size")
    elif parts.get("attention", 0) > max(parts["batch scores"], parts["evaluation scores"]):
        key, value, advice = "dataset.L", L, "lower dataset.L (attention grows with its square)"
    elif parts["evaluation scores"] > parts["batch scores"]:
        key, value, advice = "seqrec.eval_batch", cfg.seqrec.eval_batch, "lower seqrec.eval_batch"
    elif L > B:
        key, value, advice = "dataset.L", L, f"lower dataset.L or seqrec.batch_size (= {B})"
    else:
        key, value, advice = "seqrec.batch_size", cfg.seqrec.batch_size, f"lower seqrec.batch_size or dataset.L (= {L})"
    return Memory(parts, key, value, f"{advice} (M = {M} items)", device)
