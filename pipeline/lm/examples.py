"""Posts as training examples and evaluation windows, and the per-example loss.

**One post, one example** (the privacy unit): a training post is its first L + 1 tokens ("post"
then the end-of-text token, truncated), padded with the end-of-text id to L + 1; its L next-token
predictions are the example, and the tokens after them are never read by training (about half the
posts are longer than 128 tokens: their tails are lost to training, not to the guarantee). The
per-example loss is the mean cross-entropy over the post's real targets (padding excluded), so each
post weighs the same whatever its length; clipping bounds its gradient either way.

**One post, one random window** (``dataset.examples=post_window``, the DP fine-tuning's): each
time a post is sampled it is one example of L + 1 consecutive tokens at an offset drawn uniformly
(``window_rows``: every start that fits, the post's first tokens where it is shorter), fresh at
every step, so training reads the whole post over the run instead of its opening only. The
privacy unit is still the post: a step reads one window of each sampled post, whose clipped
gradient moves the sum by at most C, and the offsets are drawn independently of the data.

**Evaluation covers every token**: each post ("post" + end-of-text) is cut into consecutive,
non-overlapping windows of L + 1 tokens that overlap by one (the last token of a window is the
first input of the next), so every token after a post's first is predicted exactly once, from
the context of its own window only; padding is never a target. Perplexity is exp of the mean
loss over all predicted tokens of all posts (token-weighted), accuracy the share predicted top-1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def encode(posts: list[str], tokenizer, eos_id: int) -> list[list[int]]:
    """Each post's token ids, the end-of-text id appended."""
    return [enc.ids + [eos_id] for enc in tokenizer.encode_batch(posts)]


def training_rows(ids: list[list[int]], L: int, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, L + 1) token ids (first L + 1 of each post, padded with eos_id) and the (n, L) mask of
    real targets (a post of k tokens has k - 1 real targets, at most L)."""
    rows = torch.full((len(ids), L + 1), eos_id, dtype=torch.long)
    mask = torch.zeros(len(ids), L, dtype=torch.bool)
    for i, post in enumerate(ids):
        post = post[: L + 1]
        rows[i, : len(post)] = torch.tensor(post, dtype=torch.long)
        mask[i, : len(post) - 1] = True
    return rows, mask


@dataclass(frozen=True)
class Posts:
    """Every training post's tokens, for one window per post per step (``window_rows``)."""
    ids: torch.Tensor  # every post's tokens back to back, each followed by L + 1 end-of-text ids
    start: torch.Tensor  # (n,) where each post begins in ids
    length: torch.Tensor  # (n,) its tokens, the end-of-text id included
    L: int


def posts(ids: list[list[int]], L: int, eos_id: int) -> Posts:
    """The posts' token ids (``encode``'s) as ``Posts`` for windows of L + 1 tokens."""
    flat, start, at = [], [], 0
    for post in ids:
        start.append(at)
        flat.extend(post)
        flat.extend([eos_id] * (L + 1))
        at += len(post) + L + 1
    return Posts(torch.tensor(flat, dtype=torch.long), torch.tensor(start, dtype=torch.long),
                 torch.tensor([len(p) for p in ids], dtype=torch.long), L)


def window_rows(found: Posts, pick: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, L + 1) rows of the posts ``pick`` and their (k, L) masks of real targets: post i's window
    starts at floor(u_i s_i), s_i its number of starts (its length - L, at least 1), u_i in [0, 1).
    At u = 0 a row and its mask are ``training_rows``'s (the post's first L + 1 tokens)."""
    L = found.L
    length = found.length[pick]
    starts = (length - L).clamp(min=1)
    off = torch.minimum((u.double() * starts).long(), starts - 1)
    ahead = torch.arange(L + 1)
    rows = found.ids[(found.start[pick] + off)[:, None] + ahead]
    mask = (off[:, None] + ahead[1:]) < length[:, None]
    return rows, mask


def windows(ids: list[list[int]], L: int, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every post cut into windows of L + 1 tokens, consecutive windows sharing one token: (w, L + 1)
    ids and the (w, L) mask of the targets each window predicts (each token after a post's first
    exactly once)."""
    rows, mask, _ = windows_of(ids, L, eos_id)
    return rows, mask


def windows_of(ids: list[list[int]], L: int, eos_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``windows``, with the (w,) index of the post each window comes from."""
    rows, masks, post_of = [], [], []
    for i, post in enumerate(ids):
        for start in range(0, max(len(post) - 1, 1), L):
            piece = post[start : start + L + 1]
            if len(piece) < 2:
                continue
            row = piece + [eos_id] * (L + 1 - len(piece))
            rows.append(row)
            masks.append([True] * (len(piece) - 1) + [False] * (L + 1 - len(piece)))
            post_of.append(i)
    return (torch.tensor(rows, dtype=torch.long).reshape(-1, L + 1), torch.tensor(masks, dtype=torch.bool).reshape(-1, L),
            torch.tensor(post_of, dtype=torch.long))


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32 for the softmax; float32 and float64 as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _inputs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (n, L) inputs of (n, L + 1) rows and their positions, each contiguous."""
    n, T = rows.shape
    return rows[:, :-1].contiguous(), torch.arange(T - 1, device=rows.device).repeat(n, 1)


def _logits_and_losses(model, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, L, V) logits and (n, L) next-token cross-entropies of (n, L + 1) rows. Positions are
    given per row, (n, L): Opacus's engines need every layer's input batch first (Hugging Face
    defaults to one (1, L) row broadcast, which Phantom expands itself); inputs and positions
    contiguous (Opacus views the ids)."""
    inputs, positions = _inputs(rows)
    n, T = rows.shape
    logits = _wide(model(input_ids=inputs, position_ids=positions).logits)
    flat = F.cross_entropy(logits.reshape(n * (T - 1), -1), rows[:, 1:].reshape(-1), reduction="none")
    return logits, flat.view(n, T - 1)  # (n L, V) rows: twice as fast on a CPU as the (n, V, L) transposed view


def token_losses(model, rows: torch.Tensor) -> torch.Tensor:
    """(n, L) next-token cross-entropies of (n, L + 1) rows (a ``models.ChunkedHeadGPT2``: over the
    vocabulary in chunks, no (n, L, V) logits)."""
    token_losses_of = getattr(model, "token_losses", None)
    if token_losses_of is not None:
        return token_losses_of(*_inputs(rows), rows[:, 1:])
    return _logits_and_losses(model, rows)[1]


def example_losses(model, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """(n,) per-post losses: the mean over each post's real targets (``loss_fn`` of the engine)."""
    rows, mask = batch
    losses = token_losses(model, rows)
    m = mask.to(losses.dtype)
    return (losses * m).sum(1) / m.sum(1).clamp(min=1)


@torch.no_grad()
def evaluate(model, rows: torch.Tensor, mask: torch.Tensor, batch_size: int = 64,
             buckets: torch.Tensor | None = None, names: tuple[str, ...] = ()) -> dict[str, float]:
    """Perplexity and top-1 accuracy over every masked target of ``windows``' output, token-weighted.
    With ``buckets`` ((V,) bucket index of each token id) and their ``names``: the perplexity over
    the targets of each bucket too (``perplexity_<name>``, ``tokens_<name>``)."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    loss_sum, correct, count = 0.0, 0, 0
    part_loss = torch.zeros(len(names), dtype=torch.float64)
    part_count = torch.zeros(len(names), dtype=torch.float64)
    for i in range(0, rows.shape[0], batch_size):
        r, m = rows[i : i + batch_size].to(dev), mask[i : i + batch_size].to(dev)
        logits, losses = _logits_and_losses(model, r)
        loss_sum += float(losses[m].double().sum())
        correct += int((logits.argmax(-1) == r[:, 1:])[m].sum())
        count += int(m.sum())
        if buckets is not None:
            which = buckets[r[:, 1:][m].cpu()]
            part_loss.index_add_(0, which, losses[m].double().cpu())
            part_count.index_add_(0, which, torch.ones_like(which, dtype=torch.float64))
    model.train(was)
    mean = loss_sum / max(count, 1)
    out = {"perplexity": float(torch.tensor(mean).exp()), "loss": mean, "accuracy": correct / max(count, 1),
           "tokens": count}
    for j, name in enumerate(names):
        n = float(part_count[j])
        out[f"perplexity_{name}"] = float((part_loss[j] / n).exp()) if n else float("nan")
        out[f"tokens_{name}"] = int(n)
    return out
