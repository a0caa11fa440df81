"""Next-item models (appendix E.2): a causal Transformer, a GRU and an LSTM over item sequences.

Every model maps left-padded item ids (n, T) (0 = padding, items 1..M) to scores (n, T, M) over
all M items (full softmax, no sampled negatives). The item embedding is shared by the input
lookup and the output scores (``TiedEmbedding``) unless the model is untied, in which case the
input is an ``nn.Embedding`` and the output an ``nn.Linear`` (what Opacus's Ghost Clipping
accepts). Every trainable parameter lives in an ``nn.Linear``, ``nn.LayerNorm``,
``nn.Embedding`` or ``TiedEmbedding``: the layer types the clipping engines know.

Padding: the input embedding is multiplied by the non-padding mask (as SASRec does), attention
never looks at a padding key, and the loss ignores a position whose input or target is padding,
so a padding position contributes nothing to any gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.clipping import register
from pipeline.clipping.uses import Outer


def at_last(t: torch.Tensor, last: bool) -> torch.Tensor:
    """``last=True``'s convention, written once for every model: a (n, T, ...) tensor's last position
    kept as a time dimension of length one, (n, 1, ...) (what ranking reads); ``last=False``: ``t``."""
    return t[:, -1:] if last else t


class TiedEmbedding(nn.Module):
    """One item table E (M+1, d), row 0 padding, used twice: called on integer ids it is the
    input lookup (n, T) -> (n, T, d); called on hidden states h (n, T, d) it gives the scores
    h E[1:]^T (n, T, M) over items 1..M. Its two uses of E are registered with the shared
    clipping engine below (``tied_uses``); the engine's norm of E includes their cross term."""

    def __init__(self, n_items: int, d: int, init_std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_items + 1, d) * init_std)
        with torch.no_grad():
            self.weight[0].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return F.embedding(x, self.weight, padding_idx=0)
        return x @ self.weight[1:].T


@register(TiedEmbedding)
def tied_uses(layer: TiedEmbedding, x: torch.Tensor, g: torch.Tensor, n: int):
    """Phantom Clipping's two uses of the item table (``pipeline/clipping``): the lookup,
    G_i = sum_s onehot(x_s) e_s^T (padding row excluded), and the scores, G_i = sum_t G_t h_t^T on
    rows 1..M (G the scores' gradient). The engine's norm of E is that of their sum, its cross term
    sum_{s,t} G[t, x_s] <e_s, h_t> included (the paper's Claim 4.1, corrected: docs/dpformer.md)."""
    if not x.is_floating_point():
        ids = x.reshape(n, -1)
        e = g.reshape(n, ids.shape[1], -1) * (ids != 0).unsqueeze(-1).to(g.dtype)
        return [(layer.weight, Outer(left=ids, right=e, rows=layer.weight.shape[0], index=True))]
    h = x.reshape(n, -1, x.shape[-1])
    return [(layer.weight, Outer(left=g.reshape(n, h.shape[1], -1), right=h, rows=layer.weight.shape[0], offset=1))]


class CausalSelfAttention(nn.Module):
    """Single-head causal attention built from ``nn.Linear`` layers (so that every engine handles
    it); a query sees earlier non-padding keys and itself."""

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        if d % heads:
            raise ValueError(f"d = {d} is not divisible by heads = {heads}")
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.drop = nn.Dropout(dropout)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        """(n, T, d) -> (n, h, T, d / h)."""
        n, T, d = t.shape
        return t.view(n, T, self.heads, d // self.heads).transpose(1, 2)

    def merge(self, t: torch.Tensor) -> torch.Tensor:
        """(n, h, T, d / h) -> (n, T, d)."""
        n, h, T, dh = t.shape
        return t.transpose(1, 2).reshape(n, T, h * dh)

    def logits(self, x: torch.Tensor, last: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, values and the scaled scores <q_t, k_i> / sqrt(d / h), unmasked: (n, h, T, .); ``last``:
        the last position's query only (scores (n, h, 1, T))."""
        q, k, v = self.split(self.q(at_last(x, last))), self.split(self.k(x)), self.split(self.v(x))
        return q, v, q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, record: list | None = None,
                last: bool = False) -> torch.Tensor:
        """``record``, if a list, receives {"att": the attention weights (n, h, T, T)} (before dropout);
        ``last``: the last position attends alone ((n, 1, d) out; ``allowed`` its row, (n, 1, T))."""
        _, v, scores = self.logits(x, last)
        att = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
        if record is not None:
            record.append({"att": att.detach()})
        return self.out(self.merge(self.drop(att) @ v))


class Block(nn.Module):
    """A post-LN Transformer encoder block [36]: x = LN(x + attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, d: int, heads: int, d_ff: int, dropout: float):
        super().__init__()
        self.attn = CausalSelfAttention(d, heads, dropout)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff1, self.ff2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, allowed, record: list | None = None, last: bool = False):
        """``last``: the output at the last position only (n, 1, d) (``allowed`` its row)."""
        x = self.ln1(at_last(x, last) + self.drop(self.attn(x, allowed, record, last)))
        return self.ln2(x + self.drop(self.ff2(self.drop(F.relu(self.ff1(x))))))


class SeqModel(nn.Module):
    """The shared skeleton: item input, a sequence encoder, item scores."""

    def __init__(self, n_items: int, d: int, tied: bool, dropout: float, init_std: float):
        super().__init__()
        self.tied = tied
        if tied:
            self.items = TiedEmbedding(n_items, d, init_std)
        else:
            self.items = nn.Embedding(n_items + 1, d, padding_idx=0)
            nn.init.normal_(self.items.weight, std=init_std)
            with torch.no_grad():
                self.items.weight[0].zero_()
            self.output = nn.Linear(d, n_items, bias=False)
            nn.init.normal_(self.output.weight, std=init_std)
        self.drop = nn.Dropout(dropout)

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        return self.items(h) if self.tied else self.output(h)

    def embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = ids.contiguous()  # Opacus 1.6's embedding norm sampler crashes on strided ids
        mask = ids != 0
        return self.items(ids) * mask[..., None], mask

    def forward(self, ids: torch.Tensor, *, last: bool = False) -> torch.Tensor:
        """Scores (n, T, M); ``last``: at the last position only, (n, 1, M) (what ranking reads: the
        scores of the earlier positions, T - 1 of every T rows of the widest product, are never formed)."""
        raise NotImplementedError


class Transformer(SeqModel):
    """Appendix E.2: d = 64, 1 head, 2 blocks, learned positional embeddings, causal attention."""

    def __init__(self, n_items: int, max_len: int, *, d: int, heads: int, blocks: int, d_ff: int,
                 dropout: float, tied: bool, init_std: float):
        super().__init__(n_items, d, tied, dropout, init_std)
        self.positions = nn.Embedding(max_len, d)
        nn.init.normal_(self.positions.weight, std=init_std)
        self.blocks = nn.ModuleList(Block(d, heads, d_ff, dropout) for _ in range(blocks))

    def inputs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first block's input (items + positions, dropout applied), the item mask and the
        attention mask (causal, padding keys masked; a query always sees itself)."""
        n, T = ids.shape
        x, mask = self.embed(ids)
        # right-aligned positions (the last input is position max_len - 1); a contiguous index
        # tensor, not an expanded view (the Opacus trap above)
        pos = torch.arange(self.positions.num_embeddings - T, self.positions.num_embeddings,
                           device=ids.device).repeat(n, 1)
        x = self.drop(x + self.positions(pos))
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        allowed = causal & (mask[:, None, :] | torch.eye(T, dtype=torch.bool, device=ids.device))
        return x, mask, allowed

    def forward(self, ids: torch.Tensor, *, record: list | None = None, last: bool = False) -> torch.Tensor:
        """Scores (n, T, M); ``record``, if a list, receives each block's attention weights; ``last``: the
        scores at the last position only (n, 1, M), the last block attending from that position alone
        (the blocks before it in full: its keys and values are every position's)."""
        x, _, allowed = self.inputs(ids)
        for number, block in enumerate(self.blocks, 1):
            final = last and number == len(self.blocks)
            x = block(x, at_last(allowed, final), record, final)
        return self.scores(x)


class Recurrent(SeqModel):
    """GRU or LSTM baseline (tied embedding), cells written with ``nn.Linear`` so that the
    per-user norms of the recurrent weights are ghost norms over all time steps. The state stays
    zero through the left padding."""

    def __init__(self, n_items: int, max_len: int, *, cell: str, d: int, layers: int, dropout: float,
                 tied: bool, init_std: float):
        super().__init__(n_items, d, tied, dropout, init_std)
        gates = {"gru": 3, "lstm": 4}[cell]
        self.cell = cell
        self.ih = nn.ModuleList(nn.Linear(d, gates * d) for _ in range(layers))
        self.hh = nn.ModuleList(nn.Linear(d, gates * d) for _ in range(layers))

    def _step(self, gi, h, c, hh):
        gh = hh(h)
        if self.cell == "gru":
            ir, iz, inn = gi.chunk(3, -1)
            hr, hz, hn = gh.chunk(3, -1)
            r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
            return (1 - z) * torch.tanh(inn + r * hn) + z * h, c
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c

    def forward(self, ids: torch.Tensor, *, last: bool = False) -> torch.Tensor:
        x, mask = self.embed(ids)
        x = self.drop(x)
        for ih, hh in zip(self.ih, self.hh):
            gi = ih(x)
            h = c = x.new_zeros(x.shape[0], x.shape[-1])
            outs = []
            for t in range(x.shape[1]):
                h_new, c_new = self._step(gi[:, t], h, c, hh)
                keep = mask[:, t, None]
                h, c = torch.where(keep, h_new, h), torch.where(keep, c_new, c)
                outs.append(h)
            x = self.drop(torch.stack(outs, 1))
        return self.scores(at_last(x, last))


ARCHS = ("transformer", "gru", "lstm")  # model.arch; train.build makes each (Re-Attention: pipeline/seqrec/reattention.py)


def user_losses(scores: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-user loss (n,): the mean cross-entropy over the user's positions whose input and target
    are both items (SASRec's positions). A user with no such position has loss 0."""
    valid = (ids != 0) & (targets != 0)
    ce = F.cross_entropy(scores.flatten(0, 1), (targets - 1).clamp(min=0).flatten(), reduction="none")
    ce = ce.view_as(targets) * valid
    return ce.sum(1) / valid.sum(1).clamp(min=1)
