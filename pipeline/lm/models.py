"""The language models: Hugging Face GPT-2 built from a config with random weights (nothing is
downloaded), its input embedding tied to its output layer (``tied=True``: ``lm_head.weight is
transformer.wte.weight``) or not. Sizes are the config's: the CPU preset is 2 layers, d = 128,
L = 128; GPT-2 small is 12 layers, d = 768, 12 heads, L = 1024."""

from __future__ import annotations

import torch


def build(*, vocab_size: int, max_len: int, d: int, layers: int, heads: int, tied: bool, dropout: float,
          eos_id: int = 0):
    """A GPT-2 of this shape, weights drawn from the current torch seed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if d % heads:
        raise ValueError(f"d = {d} is not a multiple of heads = {heads}")
    config = GPT2Config(vocab_size=vocab_size, n_positions=max_len, n_embd=d, n_layer=layers, n_head=heads,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=eos_id,
                        eos_token_id=eos_id, tie_word_embeddings=tied)
    model = GPT2LMHeadModel(config)
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    return model


def parameters(model: torch.nn.Module) -> int:
    """Distinct trainable parameters (a tied table counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
