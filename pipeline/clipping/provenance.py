"""Where the examples are: a record, kept while the engine's forward pass runs, of which dimension of
each tensor indexes the batch's examples, followed from the batch through every operation.

The engine needs two facts about a step that no shape can tell it. Which rows of a layer's input and
output belong to which example (a (T, d) position table when n = T, a time-major (T, n, d) input, rows
flattened as (T n, d)), and that no example's loss depends on another example's data (a batch mean, a
BatchNorm on batch statistics, in-batch negatives, a loss that reads the other losses): each example's
clipped gradient bounds the effect of removing it only if it is that example's alone.

``Provenance`` is a ``TorchDispatchMode``: it sees every ATen operation of the forward pass, below
autograd, and labels each output from its inputs' labels, by the operation's meaning, not by sizes:

* ``Layout(dim, outer, inner)``: dimension ``dim`` indexes (o n + i) inner + r, example i (a plain
  batch dimension is (dim, 1, 1); rows flattened batch-first (n T, d) are (0, 1, T); time-major
  (T n, d) are (0, T, 1)). The batch's tensors whose leading size is n start as (0, 1, 1).
* no label: the tensor does not come from the examples (a parameter, ``torch.arange(T)``, a mask made
  from constants): every example shares it.
* ``Mixed(why)``: its values combine different examples (a reduction, a product or a softmax across
  the examples' dimension, a slice of the examples, an operation the rules do not know): every tensor
  computed from it is ``Mixed`` too. The engine refuses a step whose losses, or a recorded layer's
  input or output, are ``Mixed``.
* ``Shared(layout, shape, name)``: the output of a layer called on no example's data (positions),
  expanded over the batch by the engine so that each example's gradient of it can be read. It may only
  meet the examples' data in an elementwise operation whose result has the shape it would have had
  without the expansion; anything else would change what the model computes, and is refused.

What it proves: an operation whose output is labelled ``Layout`` computes slice i of it from slice i of
its labelled inputs and from unlabelled tensors only. The rules are written per operation (elementwise,
views, reductions, products, lookups, normalisations, attention, losses, recurrences); an operation
without a rule that reads labelled data makes ``Mixed``, so an unknown operation can make a step
refused, never wrong. What it does not see: values read on the host (``.item()``, ``bool(t)``) that
steer Python's control flow, and operations run outside PyTorch (NumPy on ``.numpy()``): a model that
branches on, or computes outside torch with, another example's values is trusted not to.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class Layout(NamedTuple):
    dim: int
    outer: int = 1
    inner: int = 1


class Mixed(NamedTuple):
    why: str


class Shared(NamedTuple):
    layout: Layout
    shape: tuple
    name: str
    key: Any = None


class Rows(NamedTuple):
    """Rows gathered by a data-dependent index (a mixture of experts' tokens routed to one expert): along
    ``dim``, entry r is example ``ids[r]``'s."""
    dim: int
    ids: Any
    outer: int = 1
    inner: int = 1


class Part(NamedTuple):
    """Examples ``start`` to ``stop - 1`` of the batch, in order, along ``dim``: a chunk ``x[start:stop]`` of a
    tensor laid out ``Layout(dim)`` (a computation that runs over the examples a chunk at a time). An
    operation on chunks of one range is read as on a batch of that many examples; ``cat`` of chunks that
    tile the batch in order is the batch again; anything else that meets a chunk is Mixed. ``dim`` None:
    one example's data, wherever it lies."""
    dim: int | None
    start: int
    stop: int
    outer: int = 1
    inner: int = 1


class Positions(NamedTuple):
    """An index tensor whose values are positions along a dimension laid out as ``layout`` (what
    ``torch.where`` returns for the examples' dimension of a mask): ``ids`` each entry's example."""
    ids: Any
    layout: Any = None


class Found(NamedTuple):
    """``nonzero``'s (k, 2) positions in a mask whose dimension ``dim`` holds the examples: ``ids`` each
    row's example."""
    dim: int
    ids: Any
    layout: Any = None


class Refusal(Exception):
    """A refusal raised inside an operation (the engine re-raises it as ``Unsupported``): not a TypeError,
    which Python's operators (``a @ b``) would turn into NotImplemented."""


class Retry(Exception):
    """The engine's guess of how a call on no example's data is read (expanded over the batch, or row by
    row as if its first dimension were the examples') is contradicted by how its output is used: the
    forward pass is run again with the other reading."""

    def __init__(self, key: Any, why: str = ""):
        super().__init__(key)
        self.key, self.why = key, why


# Elementwise operations (beside ATen's own ``pointwise`` tag): each output element reads the inputs'
# elements at its (broadcast) index only.
ELEMENTWISE = {
    "add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "where", "eq", "ne", "lt",
    "le", "gt", "ge", "masked_fill", "_to_copy", "clone", "detach", "alias", "lift_fresh", "lift_fresh_copy", "copy",
    "native_dropout", "pow", "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "logical_and", "logical_or",
    "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor", "isnan", "isinf",
    "isfinite", "type_as", "fill", "zero", "_conj", "_neg_view", "resolve_conj", "resolve_neg", "bucketize",
    "_masked_softmax_dropout", "dropout", "feature_dropout", "alpha_dropout", "hardtanh", "leaky_relu", "elu", "celu",
    "gelu", "silu", "mish", "relu", "sigmoid", "tanh", "softplus", "hardswish", "hardsigmoid", "threshold", "glu_jvp",
    "bernoulli", "uniform", "normal", "exponential", "random", "geometric", "cauchy", "log_normal",
    "log_sigmoid_forward", "real", "imag", "view_as_complex", "angle", "polar", "complex",
}
# Outputs whose values do not depend on their inputs' values (their shape or dtype only).
CREATORS = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
            "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "scalar_tensor", "sym_size",
            "sym_numel", "sym_stride", "sym_storage_offset", "_shape_as_tensor", "size", "stride", "dim"}
VIEWS = {"view", "_unsafe_view", "_reshape_alias", "reshape", "view_as"}
# Reductions over ``dim`` (removing it unless keepdim), and operations along ``dim`` that keep the shape.
REDUCE = {"sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "any", "all", "prod", "logsumexp", "var",
          "std", "var_mean", "std_mean", "linalg_vector_norm", "norm", "count_nonzero", "nansum", "nanmean",
          "median", "nanmedian", "mode", "kthvalue", "aminmax"}
ALONG = {"_softmax", "_log_softmax", "_safe_softmax", "softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp",
         "cummax", "cummin", "sort", "argsort", "topk", "_masked_softmax"}
ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_fused_attention_overrideable", "_efficient_attention_forward",
             "_flash_attention_forward", "_scaled_dot_product_attention_math"}
RECURRENT = {"lstm", "gru", "rnn_tanh", "rnn_relu"}
RANDOM = {"native_dropout", "dropout", "feature_dropout", "alpha_dropout", "bernoulli", "rrelu_with_noise",
          "_fused_dropout", "uniform", "normal", "exponential", "geometric", "cauchy", "log_normal", "random"}
LOSSES = {"nll_loss_forward", "nll_loss2d_forward", "mse_loss", "binary_cross_entropy",
          "binary_cross_entropy_with_logits", "smooth_l1_loss", "huber_loss", "soft_margin_loss", "l1_loss",
          "multilabel_margin_loss_forward", "multi_margin_loss", "kl_div", "cross_entropy_loss", "nll_loss", "nll_loss2d",
          "nll_loss_nd", "poisson_nll_loss", "margin_ranking_loss", "hinge_embedding_loss", "cosine_embedding_loss"}


def _dims(dim: Any, ndim: int) -> list[int] | None:
    """A ``dim`` argument as a list of non-negative dimensions; None (or empty) for all of them."""
    if dim is None:
        return None
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not dims:
        return None
    return [d % max(ndim, 1) for d in dims]


def _bind(func, args: tuple, kwargs: dict) -> dict:
    """The operation's arguments by name, from its schema."""
    named = dict(kwargs)
    for arg, value in zip(func._schema.arguments, args):
        named[arg.name] = value
    for arg in func._schema.arguments:
        if arg.name not in named and arg.has_default_value():
            named[arg.name] = arg.default_value
    return named


def _between(value, source: torch.Tensor, target: torch.Tensor, n: int):
    """The label of ``target`` from that of ``source``, two tensors on one storage (a view and its base):
    the examples' dimension is the one with the same stride in memory and n entries (a plain layout
    only; anything else, or no such dimension, is Mixed)."""
    if isinstance(value, Mixed) or value is None:
        return value
    if isinstance(value, Shared):
        return Mixed("a shared output written through a view")
    if isinstance(value, Part):
        return Mixed("a chunk of the examples read through a view of its storage")
    if value.outer != 1 or value.inner != 1:
        return Mixed("a flattened layout read through a view of its storage")
    stride = source.stride(value.dim)
    found = [d for d in range(target.dim()) if target.stride(d) == stride and target.shape[d] == n]
    return Layout(found[0]) if len(found) == 1 else Mixed("a view that does not keep the examples' dimension")


INDEXING = {"index", "_unsafe_index", "index_select"}


def _control(track, t) -> bool:
    """A one-element tensor that mixes the examples, used as an index: a choice of which slice to read,
    like a value read on the host (trusted as control flow is)."""
    return isinstance(t, torch.Tensor) and t.numel() == 1 and isinstance(track.get(t), Mixed)


def _same(a, b) -> bool:
    return a is b or (a.shape == b.shape and bool(torch.equal(a, b)))


def batch_tensors(batch: Any):
    """The tensors of a batch, in order, through any nesting of tuples, lists and mappings (a dict, Hugging
    Face's BatchEncoding)."""
    if isinstance(batch, torch.Tensor):
        yield batch
        return
    if isinstance(batch, dict) or hasattr(batch, "keys") and hasattr(batch, "__getitem__"):
        items = [batch[k] for k in batch.keys()]
    else:
        items = batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        yield from batch_tensors(item)


def _inputs(args: tuple, kwargs: dict):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []


class Provenance(TorchDispatchMode):
    """Labels the tensors of one forward pass of ``n`` examples (see the module's docstring). ``owned``:
    the ids of the model's parameters and buffers, which no operation may write the examples' data into
    (a running statistic updated from the batch would carry it out of the step, past the clipping)."""

    def __init__(self, n: int, owned: set[int], may_retry=lambda key: False):
        super().__init__()
        self.n, self.owned, self.may_retry = n, owned, may_retry
        self._labels: dict[int, tuple] = {}

    # --- labels ------------------------------------------------------------------------------------

    def label(self, t: torch.Tensor, value, guesses: frozenset = frozenset()) -> None:
        """``guesses``: the calls on no example's data whose outputs were read row by row on the hypothesis
        that their first dimension is the examples' (``Retry``), that this label depends on. The tensor's
        version is kept: a label is good for the values the tensor held when it was given."""
        self._labels[id(t)] = (weakref.ref(t), value, guesses, t._version)

    def _entry(self, t: Any):
        if not isinstance(t, torch.Tensor):
            return None
        entry = self._labels.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry
        # never labelled: a view made before its storage took the examples' data (a slice of a buffer, then
        # written through another view) reads its base's label, which follows every write (``_written``)
        if t._is_view():
            base = self._entry(t._base)
            if base is not None and base[1] is not None:
                return (None, _between(base[1], t._base, t, self.n), base[2], t._version)
        return None

    def get(self, t: Any):
        """The label of ``t`` (None: it does not come from the examples)."""
        entry = self._entry(t)
        return entry[1] if entry is not None else None

    def guesses(self, t: Any) -> frozenset:
        entry = self._entry(t)
        return entry[2] if entry is not None else frozenset()

    def mark(self, batch: Any) -> None:
        """Label the batch's tensors whose leading size is n: the examples, batch first."""
        for t in batch_tensors(batch):
            if t.dim() and t.shape[0] == self.n:
                self.label(t, Layout(0))

    # --- the mode -----------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        labelled = False
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                if self.get(a) is not None:
                    labelled = True
                    break
            elif isinstance(a, (list, tuple)) and any(self.get(t) is not None for t in a):
                labelled = True
                break
        try:
            out = func(*args, **kwargs)
        except Exception:
            if labelled:  # an operation the engine's expansion of a shared output made fail: a misuse, not a crash
                for t in _inputs(args, kwargs):
                    if isinstance(self.get(t), Shared):
                        raise self._misused(self.get(t), f"aten.{func.overloadpacket.__name__}") from None
            raise
        if not labelled:
            return out
        name = func.overloadpacket.__name__
        base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
        if base in CREATORS:  # public values; a tensor shaped like the examples' keeps their layout (a dropout mask)
            value = self.get(args[0]) if args else None
            if base.endswith("_like") and isinstance(value, Layout) and tuple(out.shape) == tuple(args[0].shape):
                self.label(out, value)
            return out
        guesses = frozenset().union(*(self.guesses(t) for t in _inputs(args, kwargs)))
        parts = {v for t in _inputs(args, kwargs) if isinstance(v := self.get(t), Part)}
        try:
            labels = self._on_parts(parts, func, base, args, kwargs, out) if parts else self._rule(func, base, args,
                                                                                                 kwargs, out)
        except Refusal as refusal:
            self._retry(guesses, str(refusal))
            raise
        except Retry:
            raise
        except Exception as error:  # a rule that could not read the call: the operation is not followed
            labels = Mixed(f"aten.{name} (not followed: {type(error).__name__})")
        outs = _tensors(out)
        if not isinstance(labels, list):
            labels = [labels] * len(outs)
        for t, value in zip(outs, labels):
            if value is not None:
                self.label(t, value, guesses)
        self._written(func, args, kwargs, labels[0] if labels else None)
        return out

    def _on_parts(self, parts: set, func, name: str, args, kwargs, out):
        """An operation that meets chunks of the examples (``Part``): ``cat`` of chunks tiling the batch in
        order along their dimension is the batch; an operation whose labelled inputs are all chunks of one
        range is read by its rule as on a batch of that many examples (its layouts mapped back to that
        range), and on a chunk of one example its outputs are that example's (``Part`` without a
        dimension: with one example, where it lies is not told by any shape); anything else is Mixed."""
        inputs = list(_inputs(args, kwargs))
        values = [self.get(t) for t in inputs]
        if name == "cat" and all(isinstance(v, Part) for v in values if v is not None):
            tensors = [t for t in kwargs.get("tensors", args[0] if args else ()) if not (t.dim() == 1 and t.numel() == 0)]
            d = (kwargs.get("dim", args[1] if len(args) > 1 else 0)) % tensors[0].dim()
            chunks = [self.get(t) for t in tensors]
            if all(isinstance(v, Part) and (v.outer, v.inner) == (1, 1)
                   and (v.dim == d or (v.dim is None and t.shape[d] == 1)) for v, t in zip(chunks, tensors)):
                if [v.start for v in chunks] == [0] + [v.stop for v in chunks[:-1]] and chunks[-1].stop == self.n:
                    return Layout(d)
                return Mixed("aten.cat of chunks of the examples that are not the batch in order")
        ranges = {(v.start, v.stop) for v in parts}
        if len(ranges) != 1 or any(v is not None and not isinstance(v, Part) for v in values):
            return Mixed(f"aten.{name} combining a chunk of the examples with other examples' data")
        start, stop = ranges.pop()
        if stop - start == 1:  # one example's data, and public values: that example's, wherever it lies
            outs = _tensors(out)
            return [Part(None, start, stop)] * len(outs) if len(outs) != 1 else Part(None, start, stop)
        held = {}
        for t, v in zip(inputs, values):
            if isinstance(v, Part) and id(t) not in held:
                held[id(t)] = self._labels.get(id(t))
                self.label(t, Layout(v.dim, v.outer, v.inner), self.guesses(t))
        n, self.n = self.n, stop - start
        try:
            labels = self._rule(func, name, args, kwargs, out)
        finally:
            self.n = n
            for key, entry in held.items():
                if entry is None:
                    self._labels.pop(key, None)
                else:
                    self._labels[key] = entry

        def back(value):
            if value is None or isinstance(value, Mixed):
                return value
            if isinstance(value, Layout):
                return Part(value.dim, start, stop, value.outer, value.inner)
            if isinstance(value, Part):  # a chunk of the chunk
                if value.dim is None or all(v.dim is not None and (v.outer, v.inner) == (1, 1) for v in parts):
                    return Part(value.dim, start + value.start, start + value.stop)
            return Mixed(f"aten.{name} on a chunk of the examples")

        return [back(v) for v in labels] if isinstance(labels, list) else back(labels)

    def _retry(self, guesses: frozenset, why: str = "") -> None:
        """A refusal, or a mixing where it matters (a layer's input or output, the losses), that a guessed
        row-by-row reading may have caused: the forward pass again, with the other reading of one such call
        not yet tried."""
        for key in guesses:
            if self.may_retry(key):
                raise Retry(key, why)

    def _written(self, func, args, kwargs, value) -> None:
        """An operation that writes into one of its arguments (``x.add_(h)``, ``copy_``, ``out=``): the
        written tensor takes the result's label; a parameter or buffer written with the examples' data is
        refused."""
        if not func._schema.is_mutable:
            return
        named = _bind(func, args, kwargs)
        for arg in func._schema.arguments:
            a = named.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(a, torch.Tensor):
                if value is not None and id(a) in self.owned:
                    raise Refusal(f"aten.{func.overloadpacket.__name__} writes the examples' data into a parameter "
                                      "or buffer of the model (a running statistic updated from the batch): it "
                                      "carries them out of the step, past the clipping; compute it without the "
                                      "private data, or keep it out of the model")
                if value is not None:
                    self.label(a, value)
                    if a._is_view():  # the storage's owner holds what was written through the view
                        base = a._base
                        was = self.get(base)
                        into = _between(value, a, base, self.n)
                        if was is not None and was != into:
                            into = Mixed("a write through a view that lays the examples out otherwise than its base")
                        self.label(base, into)

    # --- the rules ----------------------------------------------------------------------------------

    def _rule(self, func, name: str, args, kwargs, out):
        a = _bind(func, args, kwargs)
        outs = _tensors(out)
        if name in INDEXING and any(_control(self, t) for t in (a.get("indices") or ())):
            # a one-element index read like a host value (which expert): control, as `.item()` is; it picks a
            # slice as `select` does
            indices = list(a["indices"])
            if not all(i is None or _control(self, i) for i in indices):
                return Mixed(f"aten.{name} by an index that mixes the examples")
            t = a["self"]
            value = self.get(t)
            if value is None:
                return None
            gone = [k for k, i in enumerate(indices) if i is not None and i.dim() == 0]
            if not isinstance(value, Layout) or value.dim in gone or len(gone) != len([i for i in indices if i is not None]):
                return Mixed(f"aten.{name} by an index that mixes the examples")
            return value._replace(dim=value.dim - sum(k < value.dim for k in gone))
        inputs = [(k, v, self.get(v)) for k, v in a.items() if isinstance(v, torch.Tensor) and self.get(v) is not None]
        lists = [(k, v) for k, v in a.items() if isinstance(v, (list, tuple)) and any(self.get(t) is not None for t in v)]
        for _, _, value in inputs:
            if isinstance(value, Mixed):
                return value
        for _, seq in lists:
            for t in seq:
                if isinstance(self.get(t), Mixed):
                    return self.get(t)
        if any(isinstance(value, Found) for _, _, value in inputs):
            found = self.get(a.get("self"))
            if name == "unbind" and isinstance(found, Found) and a.get("dim", 0) % 2 == 1:
                return [Positions(found.ids, found.layout) if k == found.dim else Rows(0, found.ids)
                        for k in range(len(outs))]
            return Mixed(f"aten.{name} of found positions")
        routed = [value for _, _, value in inputs if isinstance(value, (Rows, Positions))] + [
            self.get(t) for _, seq in lists for t in seq if isinstance(self.get(t), (Rows, Positions))]
        if routed:
            return self._routed(func, name, a, inputs, lists, outs)
        shared = [(k, v, s) for k, v, s in inputs if isinstance(s, Shared)]
        if shared and not (name in ELEMENTWISE or torch.Tag.pointwise in func.tags):
            if len(inputs) == 1 and not lists:
                return self._through_shared(func, name, args, kwargs, outs, shared[0][1], shared[0][2])
            raise self._misused(shared[0][2], f"aten.{name}")
        if name in ELEMENTWISE or torch.Tag.pointwise in func.tags:
            others = [v for v in a.values() if isinstance(v, torch.Tensor) and self.get(v) is None]
            return self._elementwise(name, inputs, outs, others)
        if name in VIEWS:
            return self._view(a["self"], outs[0])
        if name == "expand":
            return self._expand(a["self"], outs[0])
        if name in ("permute", "transpose", "t", "unsqueeze", "squeeze", "select", "slice", "narrow", "movedim",
                    "diagonal", "unfold", "split", "split_with_sizes", "unbind", "chunk", "tensor_split", "flip",
                    "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk",
                    "roll", "tril", "triu", "constant_pad_nd", "repeat", "repeat_interleave", "as_strided"):
            return self._shape_op(name, a, outs)
        if name in REDUCE:
            return self._reduce(name, a, outs)
        if name in ("_fft_c2c", "_fft_r2c", "_fft_c2r"):
            t = a["self"]
            value = self.get(t)
            return Mixed(f"aten.{name} across the examples") if value.dim in _dims(a["dim"], t.dim()) else value
        if name in ("linalg_solve_triangular", "triangular_solve"):
            values = {v for v in (self.get(a.get("self")), self.get(a.get("B")), self.get(a.get("A"))) if v is not None}
            t = a.get("self")
            if len(values) == 1:
                value = values.pop()
                if isinstance(value, Layout) and value.dim < t.dim() - 2:
                    return [value] * len(outs)
            return Mixed(f"aten.{name} across the examples")
        if name == "view_as_real":
            return self.get(a["self"])
        if name in ("im2col", "col2im"):  # a convolution's patches, per image
            value = self.get(a["self"])
            return value if value.dim == 0 else Mixed(f"aten.{name} across the examples")
        if name in ALONG:
            return self._along(name, a, outs)
        if name in ("mm", "addmm", "bmm", "baddbmm", "mv", "dot", "vdot", "addmv", "_addmm_activation"):
            return self._product(name, a, outs)
        if name in ("embedding", "index_select", "gather", "index", "_unsafe_index", "take_along_dim"):
            return self._lookup(name, a, outs)
        if name in ("cat", "concat", "concatenate"):
            return self._cat(a, outs)
        if name == "stack":
            return self._stack(a, outs)
        if name in ("native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
                    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
                    "_batch_norm_with_update", "_batch_norm_no_update", "_fused_rms_norm", "rms_norm"):
            return self._norm(name, a, outs)
        if name in ATTENTION:
            return self._attention(a, outs)
        if name in LOSSES:
            return self._loss(name, a, inputs, outs)
        if name in ("convolution", "_convolution", "mkldnn_convolution", "cudnn_convolution", "conv1d", "conv2d",
                    "conv3d", "_slow_conv2d_forward", "thnn_conv2d", "slow_conv3d_forward", "conv_depthwise2d"):
            return self._convolution(a, outs)
        if name in RECURRENT:
            return self._recurrent(a, outs)
        if name == "nonzero":
            t = a["self"]
            value = self.get(t)
            if isinstance(value, Layout) and value.outer == 1 and t.dim() == 2:
                # torch.where(mask): each found entry's position along the examples' dimension tells its example
                found = outs[0]
                ids = torch.div(found[:, value.dim], value.inner, rounding_mode="floor") % self.n
                return Found(value.dim, ids, value._replace(dim=0))
            return Mixed("aten.nonzero of the examples' data")
        if name in ("scatter", "scatter_add", "scatter_reduce") and a.get("dim") is not None:
            # per-row scatters (one_hot's): each row of the index writes into its own row of the output
            t, index, src = a["self"], a["index"], a.get("src")
            d = a["dim"] % t.dim()
            values = {v for v in (self.get(t), self.get(index), self.get(src)) if v is not None}
            if len(values) == 1:
                value = values.pop()
                if (isinstance(value, Layout) and value.dim != d and index.dim() == t.dim()
                        and index.shape[value.dim] == t.shape[value.dim]
                        and (src is None or not isinstance(src, torch.Tensor) or src.dim() == 0
                             or src.shape[value.dim] == t.shape[value.dim])):
                    return value
            return Mixed(f"aten.{name} across the examples")
        if name in ("index_put", "masked_scatter", "scatter", "scatter_add", "index_add", "index_copy", "index_fill",
                    "scatter_reduce", "masked_select", "nonzero", "unique", "_unique2", "bincount", "histc"):
            return self._scatter(name, a, outs)
        if name in ("one_hot",):
            return self.get(a["self"])
        if name in ("searchsorted",):
            if self.get(a.get("sorted_sequence")) is not None:
                return Mixed("aten.searchsorted on the examples' data as its sorted sequence")
            return self.get(a.get("self"))
        return Mixed(f"aten.{name}, which the engine does not follow")

    def _through_shared(self, func, name, args, kwargs, outs, t, shared: Shared):
        """An operation on a ``Shared`` output alone (``step(s)[:, None, :]``, ``.squeeze(-1)``, ``.softmax(-1)``):
        still ``Shared`` if it treats the copies apart (its rule, with the copies as examples, keeps them
        apart) and its output is the expansion of what the unexpanded output would have given (the same
        operation run on a shape-only copy of it)."""
        entry = self._labels[id(t)]
        self._labels[id(t)] = (entry[0], shared.layout, entry[2])
        try:
            value = self._rule(func, name, args, kwargs, outs[0] if len(outs) == 1 else outs)
        finally:
            self._labels[id(t)] = entry
        values = value if isinstance(value, list) else [value] * len(outs)
        if not outs or not all(isinstance(v, Layout) and v.outer == v.inner == 1 for v in values):
            raise self._misused(shared, f"aten.{name}")
        swap = (lambda x: torch.empty(shared.shape, dtype=x.dtype, device="meta") if x is t
                else x.to("meta") if isinstance(x, torch.Tensor) else x)
        try:
            plain = _tensors(func(*[swap(x) for x in args], **{k: swap(v) for k, v in kwargs.items()}))
        except Exception:
            raise self._misused(shared, f"aten.{name}") from None
        found = []
        for out, v, alone in zip(outs, values, plain):
            size, p = tuple(alone.shape), v.dim
            if tuple(out.shape) == size and size[p] == self.n:  # already broadcast over the examples (expand_as(h))
                found.append(Shared(Layout(p), size, shared.name, shared.key))
                continue
            if tuple(out.shape) != size[:p] + (self.n,) + size[p:] and not (
                    p < len(size) and size[p] == 1 and tuple(out.shape) == size[:p] + (self.n,) + size[p + 1:]):
                raise self._misused(shared, f"aten.{name}")
            found.append(Shared(Layout(p), size, shared.name, shared.key))
        return found

    def _routed(self, func, name, a, inputs, lists, outs):
        """Operations on routed rows (``Rows``) and on the positions that route them (``Positions``): row-wise
        work keeps each row's example; writing rows back where their positions say (``index_add_``) gives the
        destination's layout only if every row lands in its own example's place, checked on the values."""
        if name == "index_add":
            t, d, index, source = a["self"], a["dim"] % a["self"].dim(), a["index"], a["source"]
            tv, iv, sv = self.get(t), self.get(index), self.get(source)
            if (isinstance(tv, Layout) and tv.dim == d and isinstance(iv, Positions) and isinstance(sv, Rows)
                    and sv.dim == d and sv.inner == 1 and _same(iv.ids, sv.ids) and iv.layout == tv._replace(dim=0)):
                return tv
            return Mixed("aten.index_add of rows into other examples' places")
        if name in ("index", "_unsafe_index"):
            t, indices = a["self"], list(a["indices"])
            tv = self.get(t)
            at = [k for k, i in enumerate(indices) if i is not None]
            first = self.get(indices[0]) if indices and indices[0] is not None else None
            ids = [self.get(indices[k]).ids for k in at if isinstance(self.get(indices[k]), (Rows, Positions))]
            if (isinstance(tv, Layout) and tv.dim == 0 and isinstance(first, Positions)
                    and first.layout == tv._replace(dim=0) and at == list(range(len(at)))
                    and all(indices[k].dim() == 1 for k in at)
                    and all(self.get(indices[k]) is None or isinstance(self.get(indices[k]), (Rows, Positions))
                            for k in at)
                    and all(_same(ids[0], other) for other in ids[1:])):
                return Rows(0, ids[0])
            return Mixed(f"aten.{name} gathering rows across the examples")
        if name == "index_put":
            t, indices, values = a["self"], [i for i in a["indices"] if i is not None], a["values"]
            tv, vv = self.get(t), self.get(values)
            if (isinstance(tv, Layout) and tv == Layout(0) and len(indices) == 1 and indices[0].dtype == torch.bool
                    and indices[0].dim() == 1 and isinstance(vv, Rows) and vv.dim == 0 and vv.inner == 1
                    and _same(vv.ids, indices[0].nonzero().squeeze(1))):
                return tv  # x[mask] = f(x[mask]): each example's rows back in its own place
            return Mixed("aten.index_put of rows into other examples' places")
        if name in ("nonzero",):
            return Mixed("aten.nonzero of routed rows")
        if name in ELEMENTWISE or torch.Tag.pointwise in func.tags or name in ("_to_copy", "clone", "detach", "alias"):
            values = [v for _, _, v in inputs] + [self.get(t) for _, seq in lists for t in seq if self.get(t) is not None]
            shape = tuple(outs[0].shape)
            dims = set()
            for (_, t, v) in inputs:
                if not isinstance(v, Rows) or not _same(v.ids, values[0].ids) or v.inner != values[0].inner:
                    return Mixed(f"aten.{name} joining routed rows with other data of the examples")
                dims.add(len(shape) - t.dim() + v.dim)
            if len(dims) != 1:
                return Mixed(f"aten.{name} joining routed rows at different places")
            return values[0]._replace(dim=dims.pop())
        if name in ("mm", "addmm", "_addmm_activation") and len(inputs) == 1:
            k, t, v = inputs[0]
            if isinstance(v, Rows) and k in ("self", "mat1") and v.dim == 0 and (name == "mm") == (k == "self"):
                return v
        if name in ("slice", "narrow", "select") and len(inputs) == 1 and isinstance(inputs[0][2], Rows):
            t, v = inputs[0][1], inputs[0][2]
            d = a["dim"] % t.dim()
            if d == v.dim:
                return Mixed(f"aten.{name} of routed rows")
            return v if name != "select" else Rows(v.dim - (d < v.dim), v.ids)
        if name in ("split", "split_with_sizes", "chunk", "unsafe_split", "unsafe_chunk", "view", "_unsafe_view",
                    "unsqueeze", "t", "transpose") and len(inputs) == 1:
            v = inputs[0][2]
            if isinstance(v, Rows):
                t = inputs[0][1]
                if name in ("view", "_unsafe_view"):
                    out = outs[0]
                    if v.dim != 0 or not out.dim() or not t.numel():
                        return Mixed("a reshape of routed rows")
                    per = v.inner * (t.numel() // t.shape[0])  # elements of one routed entry
                    width = out.numel() // out.shape[0]  # elements of one row after
                    return v._replace(inner=per // width) if per % width == 0 else Mixed("a reshape of routed rows")
                if name in ("unsqueeze",):
                    d = a["dim"] % (t.dim() + 1)
                    return Rows(v.dim + (d <= v.dim), v.ids)
                if name in ("t", "transpose"):
                    return Mixed("a transpose of routed rows")
                d = a.get("dim", 0) % t.dim()
                return [v] * len(outs) if d != v.dim else Mixed("a split of routed rows")
        return Mixed(f"aten.{name} on routed rows, which the engine does not follow")

    def _misused(self, shared: Shared, op: str) -> Exception:
        if self.may_retry(shared.key):
            return Retry(shared.key)
        return Refusal(
            f"the output of {shared.name}, which every example shares (it was called on no example's data: "
            f"positions, a step id), is used by `{op}` before it meets the examples' data: the engine expands such "
            "an output over the batch to read each example's gradient of it, and here that would change what the "
            "model computes; use it only in an elementwise operation with the examples' data (h + wpe(pos)), "
            "compute it from a batch-first input (positions expanded over the batch), or freeze the layer's "
            "parameters (requires_grad=False)")

    def _elementwise(self, name, inputs, outs, others=()):
        """Each output element from the inputs' elements at its broadcast index: the examples' dimensions of
        the labelled inputs must meet at one place of the output. A ``Shared`` input: if it meets the
        examples' data, the output must be what it would have been without the expansion; if it meets
        only unlabelled tensors (``wpe(pos).to(dtype)``, ``* sqrt(d)``), the output is ``Shared`` again,
        provided the expansion commutes with the operation (no broadcast beyond it, no random draw)."""
        if not outs:
            return None
        shape = tuple(outs[0].shape)
        found = set()
        plain = []
        for _, t, value in inputs:
            layout = value.layout if isinstance(value, Shared) else value
            aligned = len(shape) - t.dim() + layout.dim
            if aligned < 0 or t.shape[layout.dim] != shape[aligned]:
                return Mixed(f"aten.{name} broadcasting the examples' dimension")
            found.add(Layout(aligned, layout.outer, layout.inner))
            if not isinstance(value, Shared):
                plain.append(aligned)
        if len(found) != 1:
            return Mixed(f"aten.{name} combining different examples (their dimensions meet at different places)")
        shared = [(t, value) for _, t, value in inputs if isinstance(value, Shared)]
        for t, value in shared:
            rest = [tuple(u.shape) for u in others] + [tuple(u.shape) for _, u, v in inputs if u is not t]
            alone = tuple(torch.broadcast_shapes(value.shape, *rest)) if rest else tuple(value.shape)
            if plain:
                if alone != shape:
                    raise self._misused(value, f"aten.{name}")
                continue
            if name in RANDOM or len({v for _, v in shared}) != 1:
                raise self._misused(value, f"aten.{name}")
            p = next(iter(found)).dim
            if shape == alone[:p] + (self.n,) + alone[p:] or (
                    p < len(alone) and alone[p] == 1 and shape == alone[:p] + (self.n,) + alone[p + 1:]):
                return Shared(Layout(p), alone, value.name, value.key)
            raise self._misused(value, f"aten.{name}")
        return found.pop()

    def _reshaped(self, layout: Layout, before: tuple, after: tuple):
        """The layout of a reshape of ``before`` to ``after``. In the row-major index the examples are a
        digit of stride K (``inner`` times the sizes after their dimension) and extent n; it lands in the
        dimension d of ``after`` whose stride S divides K and whose span S after[d] is a multiple of K n."""
        n = self.n
        digit = layout.inner * math.prod(before[layout.dim + 1:])
        stride = 1
        for d in range(len(after) - 1, -1, -1):
            if digit % stride == 0 and after[d] % ((digit // stride) * n) == 0:
                inner = digit // stride
                return Layout(d, after[d] // (inner * n), inner)
            stride *= after[d]
        return Mixed("a reshape that splits the examples' dimension")

    def _view(self, t, out):
        value = self.get(t)
        return self._reshaped(value, tuple(t.shape), tuple(out.shape))

    def _expand(self, t, out):
        value = self.get(t)
        aligned = out.dim() - t.dim() + value.dim
        if out.shape[aligned] != t.shape[value.dim]:
            return Mixed("aten.expand along the examples' dimension")
        return Layout(aligned, value.outer, value.inner)

    def _shape_op(self, name, a, outs):
        t = a.get("self")
        value = self.get(t)
        if value is None:
            return None
        b, nd = value.dim, t.dim()
        if name == "t":
            return value._replace(dim=1 - b) if nd == 2 else value
        if name == "transpose":
            d0, d1 = a["dim0"] % nd, a["dim1"] % nd
            return value._replace(dim=d1 if b == d0 else d0 if b == d1 else b)
        if name == "permute":
            return value._replace(dim=[d % nd for d in a["dims"]].index(b))
        if name == "movedim":
            return Mixed("aten.movedim")
        if name == "diagonal":
            d1, d2 = a.get("dim1", 0) % nd, a.get("dim2", 1) % nd
            if b in (d1, d2):
                return Mixed("aten.diagonal across the examples")
            return value._replace(dim=b - (d1 < b) - (d2 < b))
        if name == "unsqueeze":
            d = a["dim"] % (nd + 1)
            return value._replace(dim=b + 1 if d <= b else b)
        if name == "squeeze":
            dims = _dims(a.get("dim"), nd)
            dims = [d for d in (dims if dims is not None else range(nd)) if t.shape[d] == 1]
            if b in dims:
                return Mixed("aten.squeeze of the examples' dimension")
            return value._replace(dim=b - sum(d < b for d in dims))
        if name == "select":
            d = a["dim"] % nd
            if d == b:
                return Mixed("aten.select of one example (x[i])")
            return value._replace(dim=b - (d < b))
        if name in ("slice", "narrow"):
            d = a["dim"] % nd
            if d == b and tuple(outs[0].shape) != tuple(t.shape):
                if isinstance(value, Layout) and (value.outer, value.inner) == (1, 1) and a.get("step", 1) == 1:
                    size = t.shape[d]
                    start = a.get("start") or 0
                    start = min(max(start + size if start < 0 else start, 0), size)
                    if start + outs[0].shape[d] <= size:  # examples start..start + k - 1, in order: a chunk
                        return Part(d, start, start + outs[0].shape[d])
                return Mixed(f"aten.{name} of some of the examples (x[:k])")
            return value
        if name in ("split", "split_with_sizes", "chunk", "tensor_split", "unsafe_split", "unsafe_split_with_sizes",
                    "unsafe_chunk"):
            d = a.get("dim", 0) % nd
            if d == b and len(outs) > 1:
                return Mixed(f"aten.{name} of the examples' dimension")
            return [value] * len(outs)
        if name == "unbind":
            d = a.get("dim", 0) % nd
            if d == b:
                return Mixed("aten.unbind of the examples (one tensor per example)")
            return [value._replace(dim=b - (d < b))] * len(outs)
        if name in ("flip", "roll"):
            dims = _dims(a.get("dims"), nd)
            if dims is None or b in dims:
                return Mixed(f"aten.{name} across the examples")
            return value
        if name in ("tril", "triu"):
            return Mixed(f"aten.{name} across the examples") if b >= nd - 2 else value
        if name == "constant_pad_nd":
            pad = list(a["pad"])
            padded = {nd - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]}
            return Mixed("aten.constant_pad_nd of the examples' dimension") if b in padded else value
        if name == "repeat":
            reps = list(a["repeats"])
            aligned = len(reps) - nd + b
            return Mixed("aten.repeat of the examples") if reps[aligned] != 1 else value._replace(dim=aligned)
        if name == "unfold":
            return Mixed("aten.unfold of the examples' dimension") if a["dimension"] % nd == b else value
        if name == "repeat_interleave":
            dim = a.get("dim")
            return Mixed("aten.repeat_interleave of the examples") if dim is None or dim % nd == b else value
        return Mixed(f"aten.{name} on the examples' data")

    def _reduce(self, name, a, outs):
        t = a.get("self", a.get("input"))
        value = self.get(t)
        nd = t.dim()
        dims = _dims(a.get("dim"), nd)
        if dims is None or value.dim in dims:
            return Mixed(f"aten.{name} over the examples (a batch statistic)")
        keep = a.get("keepdim", False)
        return value._replace(dim=value.dim if keep else value.dim - sum(d < value.dim for d in dims))

    def _along(self, name, a, outs):
        t = a.get("self", a.get("input"))
        value = self.get(t)
        d = a.get("dim", -1)
        if d is None or d % t.dim() == value.dim:
            return Mixed(f"aten.{name} across the examples")
        return value

    def _product(self, name, a, outs):
        if name in ("addmm", "_addmm_activation"):
            left, right, extra = a["mat1"], a["mat2"], a.get("self")
        elif name in ("mm", "bmm"):
            left, right, extra = a["self"], a["mat2"], None
        elif name == "baddbmm":
            left, right, extra = a["batch1"], a["batch2"], a.get("self")
        elif name in ("mv", "addmv"):
            left, right, extra = a["mat"] if "mat" in a else a["self"], a["vec"], a.get("self") if name == "addmv" else None
        else:
            return Mixed(f"aten.{name} over the examples")
        nd = left.dim()
        found = set()
        lv, rv = self.get(left), self.get(right)
        if lv is not None:
            if lv.dim == nd - 1:  # the contracted dimension
                return Mixed(f"aten.{name} summing over the examples")
            found.add(lv)
        if rv is not None:
            if right.dim() == 1 or rv.dim == right.dim() - 2:
                return Mixed(f"aten.{name} summing over the examples")
            found.add(rv)
        out = outs[0]
        if extra is not None and self.get(extra) is not None:
            ev = self.get(extra)
            found.add(ev._replace(dim=out.dim() - extra.dim() + ev.dim))
        if len(found) != 1:
            return Mixed(f"aten.{name} pairing different examples (x @ y.T across the batch)")
        return found.pop()

    def _lookup(self, name, a, outs):
        out = outs[0]
        if name == "embedding":
            if self.get(a["weight"]) is not None:
                return Mixed("aten.embedding from a table made of the examples' data")
            return self.get(a["indices"])
        if name == "index_select":
            t, d, index = a["self"], a["dim"] % max(a["self"].dim(), 1), a["index"]
            tv, iv = self.get(t), self.get(index)
            if tv is not None and iv is not None or tv is not None and tv.dim == d:
                return Mixed("aten.index_select across the examples")
            return tv if tv is not None else Layout(d, iv.outer, iv.inner)
        if name in ("gather", "take_along_dim"):
            t, index = a.get("self"), a.get("index", a.get("indices"))
            d = a.get("dim")
            if d is None:
                return Mixed(f"aten.{name} over the flattened examples")
            d %= t.dim()
            tv, iv = self.get(t), self.get(index)
            found = {v.dim for v in (tv, iv) if v is not None}
            if d in found or len({v for v in (tv, iv) if v is not None}) != 1:
                return Mixed(f"aten.{name} across the examples")
            value = tv if tv is not None else iv
            if index.shape[value.dim] != t.shape[value.dim]:
                return Mixed(f"aten.{name} across the examples")
            return value
        return self._index(a["self"], list(a["indices"]), out)

    def _index(self, t, indices, out):
        """``x[i, j]`` with index tensors (advanced indexing): the indexed dimensions are replaced by the
        broadcast shape of the indices, in place when they are adjacent, first otherwise."""
        at = [k for k, i in enumerate(indices) if i is not None]
        if any(i.dtype == torch.bool for i in indices if i is not None):
            tv = self.get(t)
            if (len(at) == 1 and at[0] == 0 and tv == Layout(0) and indices[0].dim() == 1
                    and self.get(indices[0]) in (Layout(0), None)):
                return Rows(0, indices[0].nonzero().squeeze(1))  # x[mask]: some examples' rows, each still its own
            return Mixed("aten.index with a boolean mask (x[mask]): its rows are no longer the examples'")
        shape = tuple(torch.broadcast_shapes(*[tuple(indices[k].shape) for k in at]))
        adjacent = at == list(range(at[0], at[0] + len(at)))
        start = at[0] if adjacent else 0
        found = set()
        tv = self.get(t)
        if tv is not None:
            if tv.dim in at:
                # x[torch.arange(n)[:, None], ...]: the examples in their order, on one dimension of the index
                index = indices[tv.dim]
                sizes = [k for k, size in enumerate(index.shape) if size != 1]
                identity = (tv == Layout(tv.dim) and self.get(index) is None and index.numel() == self.n
                            and len(sizes) == 1 and not index.is_floating_point()
                            and bool((index.reshape(-1) == torch.arange(self.n, device=index.device)).all()))
                if not identity:
                    return Mixed("aten.index selecting among the examples (x[idx])")
                found.add(Layout(start + len(shape) - index.dim() + sizes[0]))
            elif adjacent:
                found.add(tv._replace(dim=tv.dim if tv.dim < at[0] else tv.dim - len(at) + len(shape)))
            else:
                found.add(tv._replace(dim=len(shape) + sum(1 for k in range(tv.dim) if k not in at)))
        for k in at:
            iv = self.get(indices[k])
            if iv is not None:
                found.add(iv._replace(dim=start + len(shape) - indices[k].dim() + iv.dim))
        if len(found) != 1:
            return Mixed("aten.index pairing different examples")
        return found.pop()

    def _cat(self, a, outs):
        tensors = [t for t in a["tensors"] if not (t.dim() == 1 and t.numel() == 0)]  # cat's legacy empty (0,)
        d = a.get("dim", 0)
        found = set()
        for t in tensors:
            value = self.get(t)
            if value is None:
                continue
            if isinstance(value, Shared):
                raise self._misused(value, "aten.cat")
            found.add(value)
        if len(found) != 1:
            return Mixed("aten.cat of tensors laid out differently")
        value = found.pop()
        if value.dim == d % tensors[0].dim():
            # whole batches one after another (a recurrence's steps stacked time-major): the examples repeat
            # with the same stride, one more outer block per piece; anything else joins parts of batches
            if all(self.get(t) == value and t.shape == tensors[0].shape for t in tensors):
                return value._replace(outer=value.outer * len(tensors))
            return Mixed("aten.cat along the examples' dimension")
        return value

    def _stack(self, a, outs):
        """Tensors laid out alike stacked on a new dimension (a recurrence's steps): the examples' dimension
        moves past it if it comes at or before theirs."""
        tensors = list(a["tensors"])
        values = {self.get(t) for t in tensors} - {None}
        if len(values) != 1:
            return Mixed("aten.stack of tensors laid out differently")
        value = values.pop()
        if isinstance(value, Shared):
            raise self._misused(value, "aten.stack")
        d = a.get("dim", 0) % (tensors[0].dim() + 1)
        return value._replace(dim=value.dim + 1 if d <= value.dim else value.dim)

    def _norm(self, name, a, outs):
        t = a["input"]
        value = self.get(t)
        if any(self.get(a.get(k)) is not None for k in ("weight", "bias", "running_mean", "running_var")):
            return Mixed(f"aten.{name} with statistics or weights made from the examples")
        if value is None:
            return None
        nd = t.dim()
        if name == "native_layer_norm":
            last = len(a["normalized_shape"])
            return Mixed("aten.native_layer_norm over the examples' dimension") if value.dim >= nd - last else value
        if name in ("_fused_rms_norm", "rms_norm"):
            last = len(a["normalized_shape"])
            return Mixed(f"aten.{name} over the examples' dimension") if value.dim >= nd - last else value
        if name == "native_group_norm":
            return value if value.dim == 0 else Mixed("aten.native_group_norm with the examples off dimension 0")
        training = a.get("training", name not in ("_native_batch_norm_legit_no_training", "_batch_norm_no_update"))
        if training:
            return Mixed(f"aten.{name} on the batch's statistics (a BatchNorm in training mode)")
        return value if value.dim != 1 else Mixed(f"aten.{name} with the examples on the channel dimension")

    def _attention(self, a, outs):
        q, k, v = a["query"], a["key"], a["value"]
        found = set()
        for t in (q, k, v):
            value = self.get(t)
            if value is not None:
                if value.dim >= t.dim() - 2:
                    return Mixed("attention across the examples (the examples on the sequence dimension)")
                found.add(value)
        mask = a.get("attn_mask", a.get("attn_bias"))
        if isinstance(mask, torch.Tensor) and self.get(mask) is not None:
            mv = self.get(mask)
            found.add(mv._replace(dim=q.dim() - mask.dim() + mv.dim))
        if len(found) != 1:
            return Mixed("attention pairing different examples")
        value = found.pop()
        return [value] * len(outs)

    def _loss(self, name, a, inputs, outs):
        if a.get("reduction", 1) != 0:
            return Mixed(f"aten.{name} reduced over the examples (reduction='mean' or 'sum': one loss for the batch)")
        if name in ("nll_loss_forward", "nll_loss2d_forward"):
            tv, sv = self.get(a["target"]), self.get(a["self"])
            if sv is not None and tv is not None and sv.dim != tv.dim:
                return Mixed(f"aten.{name} pairing different examples")
            value = tv if tv is not None else sv
            return [value, Mixed(f"aten.{name}'s total weight")]
        return self._elementwise(name, inputs, outs)

    def _convolution(self, a, outs):
        if self.get(a.get("weight")) is not None:
            return Mixed("a convolution whose kernel is made from the examples' data")
        value = self.get(a["input"])
        return value if value is not None and value.dim == 0 else Mixed("a convolution across the examples")

    def _recurrent(self, a, outs):
        x = a["input"]
        value = self.get(x)
        first = bool(a.get("batch_first", False))
        if x.dim() != 3 or (value is not None and value.dim != (0 if first else 1)):
            return Mixed("a recurrence along the examples (the examples on the time dimension)")
        hx = a.get("hx")
        for h in (hx if isinstance(hx, (list, tuple)) else [hx]):
            hv = self.get(h)
            if hv is not None and hv.dim != 1:
                return Mixed("a recurrence whose state is laid out across the examples")
        step = value or Layout(0 if first else 1)
        return [step] + [Layout(1)] * (len(outs) - 1)

    def _scatter(self, name, a, outs):
        t = a.get("self")
        if name == "index_put":
            indices = [i for i in a["indices"] if i is not None]
            values = a["values"]
            tv = self.get(t)
            mask = indices[0] if len(indices) == 1 else None
            if (mask is not None and mask.dtype == torch.bool and tuple(mask.shape) == tuple(t.shape[:mask.dim()])
                    and self.get(mask) in (tv, None) and self.get(values) is None
                    and (values.numel() <= 1 or tuple(values.shape) == tuple(t.shape[mask.dim():]))):
                return tv if tv is not None else self.get(mask)  # x[mask] = value: a masked fill
        return Mixed(f"aten.{name} with the examples' data")
