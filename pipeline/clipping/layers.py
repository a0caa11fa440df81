"""What each layer type contributes to its parameters' per-example gradients (Opacus's pattern of a
registry of per-layer functions): ``LAYERS[type](layer, input, grad_output, n) -> [(parameter, use)]``
with ``use`` an ``Outer`` or ``Direct`` (``pipeline/clipping/uses.py``), for one call of the layer on
a batch of n examples (batch first).

Known: ``nn.Linear``, ``nn.Embedding`` (``padding_idx`` included), ``nn.LayerNorm``, ``nn.RMSNorm``,
and Hugging Face's ``Conv1D`` (GPT-2's projections, a linear layer with its weight stored
transposed) and RMSNorms (Llama, Qwen2, Qwen3, Mistral), registered by name so that transformers
need not be installed. Adding a type is one function and one ``@register``;
a layer whose parameters need no per-example treatment it cannot give is refused by the engine.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pipeline.clipping.uses import Direct, Outer

LAYERS: dict[type | str, Callable] = {}


def register(layer: type | str):
    """``@register(nn.Linear)``, or a ``"module.QualName"`` string for a type not imported here."""
    def wrap(fn):
        LAYERS[layer] = fn
        return fn
    return wrap


def lookup(module: nn.Module) -> Callable | None:
    kind = type(module)
    if len(kind.__bases__) == 2 and kind.__bases__[0].__name__ == "FSDPModule":  # FSDP2's FSDP<Layer>: the layer's
        kind = kind.__bases__[1]  # own type (fully_shard changes the instance's class, adding no forward)
    return LAYERS.get(kind) or LAYERS.get(f"{kind.__module__}.{kind.__qualname__}")


def _tokens(t: torch.Tensor, n: int) -> torch.Tensor:
    """(n, ..., k) -> (n, tokens, k)."""
    return t.reshape(n, -1, t.shape[-1])


def _bias(g: torch.Tensor) -> Direct:
    """A bias b of y = ... + b: G_i = sum_t g_it, kept per token (the calls of a reused layer join)."""
    return Direct(tokens=g)


@register(nn.Linear)
def linear(layer: nn.Linear, x: torch.Tensor, g: torch.Tensor, n: int):
    """y = x W^T + b, W (out, in): G_i = sum_t g_t x_t^T."""
    x, g = _tokens(x, n), _tokens(g, n)
    uses = [(layer.weight, Outer(left=g, right=x, rows=layer.out_features))]
    if layer.bias is not None:
        uses.append((layer.bias, _bias(g)))
    return uses


@register("transformers.pytorch_utils.Conv1D")
def conv1d(layer, x: torch.Tensor, g: torch.Tensor, n: int):
    """Hugging Face's Conv1D: y = x W + b, W (in, out): G_i = sum_t x_t g_t^T."""
    x, g = _tokens(x, n), _tokens(g, n)
    return [(layer.weight, Outer(left=x, right=g, rows=layer.weight.shape[0])), (layer.bias, _bias(g))]


@register(nn.Embedding)
def embedding(layer: nn.Embedding, ids: torch.Tensor, g: torch.Tensor, n: int):
    """y = W[id], W (num_embeddings, dim): G_i = sum_t onehot(id_t) g_t^T; the padding row gets none."""
    ids, g = ids.reshape(n, -1), _tokens(g, n)
    if layer.padding_idx is not None:
        g = g * (ids != layer.padding_idx).unsqueeze(-1).to(g.dtype)
    return [(layer.weight, Outer(left=ids, right=g, rows=layer.num_embeddings, index=True))]


def _normalised(layer, x: torch.Tensor, rms: bool) -> torch.Tensor:
    dims = tuple(range(-len(layer.normalized_shape), 0))
    eps = layer.eps if layer.eps is not None else torch.finfo(x.dtype).eps
    if rms:
        return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    if isinstance(layer, nn.LayerNorm):  # its forward's own normalisation
        return torch.nn.functional.layer_norm(x, layer.normalized_shape, eps=layer.eps)
    mean = x.mean(dims, keepdim=True)
    return (x - mean) * torch.rsqrt(x.var(dims, unbiased=False, keepdim=True) + eps)


def _norm_layer(layer, x: torch.Tensor, g: torch.Tensor, n: int, rms: bool):
    """y = xhat * w + b over the last dims: G_i(w) = sum_t g_t * xhat_t, G_i(b) = sum_t g_t, kept per token."""
    size = 1
    for k in layer.normalized_shape:
        size *= k
    uses = []
    if layer.weight is not None:
        xhat = _normalised(layer, x.to(g.dtype), rms)
        uses.append((layer.weight, Direct(tokens=(g * xhat).reshape(n, -1, size))))
    if getattr(layer, "bias", None) is not None:
        uses.append((layer.bias, Direct(tokens=g.reshape(n, -1, size))))
    return uses


@register(nn.LayerNorm)
def layer_norm(layer: nn.LayerNorm, x: torch.Tensor, g: torch.Tensor, n: int):
    return _norm_layer(layer, x, g, n, rms=False)


def hf_rms_norm(layer, x: torch.Tensor, g: torch.Tensor, n: int):
    """Hugging Face's RMSNorm (Llama, Qwen2, Mistral, ...): y = w * (x / rms(x)), the normalisation
    in float32 then cast back to x's dtype, as its forward does; G_i(w) = sum_t g_t * xhat_t."""
    h = x.to(torch.float32)
    xhat = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)).to(x.dtype).to(g.dtype)
    return [(layer.weight, Direct(tokens=(g * xhat).reshape(n, -1, xhat.shape[-1])))]


for _name in ("llama.modeling_llama.LlamaRMSNorm", "qwen2.modeling_qwen2.Qwen2RMSNorm",
              "mistral.modeling_mistral.MistralRMSNorm", "qwen3.modeling_qwen3.Qwen3RMSNorm"):
    register(f"transformers.models.{_name}")(hf_rms_norm)


if hasattr(nn, "RMSNorm"):  # torch >= 2.4
    @register(nn.RMSNorm)
    def rms_norm(layer, x: torch.Tensor, g: torch.Tensor, n: int):
        return _norm_layer(layer, x, g, n, rms=True)
