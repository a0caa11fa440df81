"""The language models: Hugging Face GPT-2 built from a config with random weights (nothing is
downloaded), its input embedding tied to its output layer (``tied=True``: ``lm_head.weight is
transformer.wte.weight``) or not. Sizes are the config's: the CPU preset is 2 layers, d = 128,
L = 128; GPT-2 small is 12 layers, d = 768, 12 heads, L = 1024. ``chunked_head`` (``model.chunked_head``):
the training loss reads the output layer over the vocabulary in chunks (``ChunkedHeadGPT2``)."""

from __future__ import annotations

import torch


def build(*, vocab_size: int, max_len: int, d: int, layers: int, heads: int, tied: bool, dropout: float,
          eos_id: int = 0, chunked_head: int = 0):
    """A GPT-2 of this shape, weights drawn from the current torch seed (``chunked_head`` > 0: in a
    ``ChunkedHeadGPT2`` reading that many vocabulary rows at a time; the same weights)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if d % heads:
        raise ValueError(f"d = {d} is not a multiple of heads = {heads}")
    config = GPT2Config(vocab_size=vocab_size, n_positions=max_len, n_embd=d, n_layer=layers, n_head=heads,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=eos_id,
                        eos_token_id=eos_id, tie_word_embeddings=tied)
    model = GPT2LMHeadModel(config)
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    return ChunkedHeadGPT2(model, chunked_head) if chunked_head else model


class ChunkedHeadGPT2(torch.nn.Module):
    """A GPT-2 whose training loss reads its output layer ``chunk`` vocabulary rows at a time
    (``pipeline.clipping.chunked.ChunkedTiedHead`` on ``lm_head``'s weight, which is the embedding's
    when tied): a training step forms no (n, L, V) logits, and the clipping engine reads the head's
    per-post norms in chunks too (docs/clipping.md). Calling it calls the GPT-2 (whole logits: the
    evaluation's accuracy needs them); its state dict is the GPT-2's, so checkpoints and pretrained
    files are the same with the option on or off."""

    def __init__(self, gpt2, chunk: int):
        from pipeline.clipping.chunked import ChunkedTiedHead

        super().__init__()
        self.gpt2 = gpt2
        self.head = ChunkedTiedHead(gpt2.lm_head, chunk=chunk)

    def forward(self, *args, **kwargs):
        return self.gpt2(*args, **kwargs)

    def token_losses(self, inputs: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(n, L) next-token cross-entropies of ``targets`` after ``inputs`` (both (n, L))."""
        return self.head(self.gpt2.transformer(input_ids=inputs, position_ids=positions).last_hidden_state, targets)

    def state_dict(self, *args, **kwargs):
        return self.gpt2.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.gpt2.load_state_dict(state_dict, strict=strict, assign=assign)


def parameters(model: torch.nn.Module) -> int:
    """Distinct trainable parameters (a tied table counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
