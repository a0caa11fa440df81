"""The tiny tied model and data of tests/test_distributed.py (shared with its worker processes)."""

import torch
import torch.nn.functional as F
from torch import nn

V, T, N = 13, 6, 64


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 8)
        self.pos = nn.Embedding(T, 8)
        self.norm = nn.LayerNorm(8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, V, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))  # nanoGPT's positions, as written
        return self.out(torch.tanh(self.mid(self.norm(h))))


def tied_model() -> nn.Module:
    return Tied().double()


def untied_model() -> nn.Module:
    """The same model with its own output table (drawn from the torch seed after the tied one's weights)."""
    model = Tied().double()
    model.out.weight = nn.Parameter(torch.randn(V, 8, dtype=torch.double) * 0.3)
    return model


def data() -> torch.Tensor:
    return torch.randint(0, V, (N, T + 1), generator=torch.Generator().manual_seed(3))


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").sum(1)


def gpt2_model() -> nn.Module:
    """A Hugging Face GPT-2 built from a config (random weights), tied as shipped, without dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=V, n_positions=T, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    return GPT2LMHeadModel(config).double()


def gpt2_loss(model, batch):
    logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").sum(1)


MODELS = {"tied": (tied_model, loss_fn), "untied": (untied_model, loss_fn), "gpt2": (gpt2_model, gpt2_loss)}
# FSDP2's units below the root, per model (tests/distributed_worker.py's fsdp mode): a linear layer and a LayerNorm
# of the toy model; each block of GPT-2
UNITS = {"tied": lambda m: [m.mid, m.norm], "untied": lambda m: [m.mid, m.norm], "gpt2": lambda m: list(m.transformer.h)}
