"""Phantom Clipping for any ``torch.nn.Module``: exact per-example gradient norms, tied weights
included, and the clipped sum of per-example gradients, without per-example gradients.

    engine = PhantomClipping(model, C=1.0)
    losses, norms = engine.step(loss_fn, batch)     # p.grad = sum_i c_i g_i, c_i = min(1, C / ||g_i||)

``loss_fn(model, batch)`` returns the (n,) per-example losses (the batch can be any structure). One
forward pass records every call of every layer that holds a trainable parameter (its input, and its
output's gradient from one ``autograd.grad`` of the summed losses with respect to the layers'
outputs: no parameter gradient is formed). Each layer's registered function (``layers.py``) turns a
call into the per-example gradient it contributes to each of its parameters (``uses.py``). A
parameter is found by identity wherever it is held: Hugging Face's ``lm_head.weight is
wte.weight``, an ``nn.Embedding`` and an ``nn.Linear`` sharing one ``Parameter``, a block reused
across depth. Its per-example squared norm sums the inner products of all its uses, cross terms
included, so it is that of the sum of the uses' gradients, exactly.

The clipped sum is formed by book-keeping (``sum_by="bookkeeping"``: from the recorded factors,
weighted by c_i; no second pass) or by a second backward pass of sum_i c_i L_i through the same
graph (``sum_by="backward"``).

What it cannot see it refuses (``Unsupported``), never computing a smaller norm. On every step, the
guard (``guard.py``) proves from the step's autograd graph, before any gradient is formed, that every
path from the losses to a trainable parameter passes through a recorded call of a layer holding it:
a parameter also used elsewhere (``F.linear(h, self.wte.weight)``, a penalty on it, a use on a few
examples or steps only) is refused on the step it appears, naming the parameter and the operation.
Every forward pass of more than one example runs under the step's provenance (``provenance.py``):
which dimension of every tensor holds the examples, followed from the batch through every ATen
operation; losses, or a layer's input or output, that mix the examples (a batch mean, BatchNorm on
batch statistics, in-batch negatives) are refused on the step, and each call's rows are read as the
examples they belong to (time-major and flattened calls included), never by a shape coincidence. A
layer called on no example's data (positions) is read expanded over the batch or row by row, as the
provenance proves right. Before each forward pass (``_refuse_unseen``): hooks that would act before
the engine records a call or rewrite gradients, a BatchNorm on batch statistics. At construction: an
embedding whose gradient is scaled by the batch's counts, a parametrized layer. Layers without a
registered function are read exactly all the same (``functional.py``): subclasses of
``nn.Embedding`` and ``nn.Linear`` at their base's functional call, every other layer by
``torch.func`` (its per-example gradients materialised: register a function for a large matrix),
each checked to add up to the batch's gradient. A parameter held by a layer and by a module around
it (BERT's prediction head's ``bias``, its decoder's too) is counted once, at the layer. A layer's
output gradient is read at the layer's autograd edge (its base's, for an output that is a whole view
of a product), not at its output tensor: the engine holds no output (a language model's logits)
through the gradient pass, and an in-place change of an output after its layer
(``ReLU(inplace=True)``) is exact; of a partial view, refused. ``check="brute"`` adds, on every step,
a comparison of every example's per-parameter norms with one backward pass per example: a test of
layer functions (a wrong registration is named as such), with a tolerance from the dtype and sizes.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten
from torch.nn.modules import module as torch_module  # torch's global module hooks
from torch.nn.utils import parametrize

from pipeline.clipping import functional, guard
from pipeline.clipping.guard import Unsupported
from pipeline.clipping.layers import lookup
from pipeline.clipping.provenance import (Layout, Mixed, Part, Positions, Provenance, Refusal, Retry, Rows, Shared,
                                          batch_tensors)
from pipeline.clipping.uses import Outer, Stack, Use, inner, merged, stack_key

RULES = ("classic", "automatic")
CHECKS = ("guard", "brute")
SUM_BY = ("bookkeeping", "backward")
FORMS = ("auto", "gram", "direct")
BATCH_STATISTICS = nn.modules.batchnorm._BatchNorm  # in training mode (or without running statistics): examples mix


def coefficients(norms: torch.Tensor, *, C: float, rule: str = "classic", gamma: float = 0.01) -> torch.Tensor:
    """Per-example scale c_i with ||c_i g_i|| <= C: ``classic`` (Abadi et al., Opacus) min(1, C /
    (||g_i|| + 1e-6)); ``automatic`` (Bu et al., DPFormer's choice) C / (||g_i|| + gamma)."""
    if rule == "automatic":
        return C / (norms + gamma)
    if rule == "classic":
        return (C / (norms + 1e-6)).clamp(max=1.0)
    raise ValueError(f"unknown clipping rule {rule!r}; known: {RULES}")


def _wide(t: torch.Tensor) -> torch.Tensor:
    """Half-precision factors in float32: squared norms in float16 overflow (c = 0) and in bfloat16
    come out below the truth; under autocast a layer's input and output differ in dtype."""
    return t.float() if t.is_floating_point() and t.dtype in (torch.float16, torch.bfloat16) else t


def _shape(p: nn.Parameter) -> tuple[int, int]:
    """The (P, Q) a per-example gradient of ``p`` is handled as: a matrix as it is, a vector or a
    scalar as (1, Q)."""
    if p.dim() <= 1 or p.numel() == 0:  # a vector, a scalar, or a parameter with no entries (a width of 0)
        return 1, p.numel() if p.numel() == 0 else max(1, p.numel())
    return p.shape[0], p.numel() // p.shape[0]


def _plain_reshape(view: torch.Tensor, base: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``view`` is one reshape of ``base`` (same elements in the same order: its gradient is the
    base's reshaped) made by the layer's own call (not a view of its input, whose gradient has other
    users): nn.Linear and Conv1D on (n, T, d) inputs, which reshape their 2-D product. A transposed or
    permuted view has the same number of elements in another order, and is not one."""
    return (base.grad_fn is not None and base.numel() == view.numel() and base.dtype == view.dtype
            and view.is_contiguous() and base.is_contiguous() and view.storage_offset() == base.storage_offset()
            and view.grad_fn is not None and view.grad_fn.next_functions[0][0] is base.grad_fn
            and base is not x and base is not getattr(x, "_base", None))


def _pair(edge) -> tuple:
    """A gradient edge as the (node, output number) pair that ``next_functions`` lists."""
    return edge.node, edge.output_nr


def _batch_size(batch: Any) -> int | None:
    """The leading size of the first tensor in the batch with a dimension (``provenance.batch_tensors``):
    the number of examples, by the engine's batch-first contract."""
    return next((t.shape[0] for t in batch_tensors(batch) if t.dim()), None)


_REGISTER_HOOK = torch.Tensor.register_hook


def _name_of(hook) -> str:
    """A hook's name for a message: its qualified name, or its type's."""
    return getattr(hook, "__qualname__", None) or getattr(getattr(hook, "func", None), "__qualname__", None) \
        or type(hook).__qualname__


def _fsdp_pre_backward(hook) -> bool:
    """Whether ``hook`` is FSDP2's pre-backward hook (``fully_shard``): it gathers the module's parameters
    before its backward and returns the gradient unchanged."""
    state = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_state")  # never imported: no FSDP2 here
    return state is not None and getattr(hook, "__func__", None) is getattr(state.FSDPState, "_pre_backward", None)


def _refuse_gradient_hook(tensor: torch.Tensor, hook: Callable):
    """``Tensor.register_hook`` while the engine runs a forward pass: a hook on an intermediate gradient can
    rewrite what the engine reads (a division by the batch's gradient norm mixes the examples), and the
    autograd graph does not show it to the guard: refused where it is registered. FSDP2's pre-backward hook
    (an identity on the gradient) is let through."""
    if _fsdp_pre_backward(hook):
        return _REGISTER_HOOK(tensor, hook)
    raise Unsupported(f"a gradient hook ({_name_of(hook)}) was registered on a tensor during the forward pass "
                      "(tensor.register_hook): it can rewrite the gradients the engine reads, mixing the examples or "
                      "scaling one of them, and no per-example bound then holds; remove it while training with the "
                      "engine")


def _examples_apart(value) -> None:
    """Refuse losses that are not one per example, each from its own example's data (their provenance)."""
    if value == Layout(0):
        return
    if isinstance(value, Mixed):
        raise Unsupported(f"the losses mix the examples of the batch ({value.why}): each example's loss must depend "
                          "on that example's data only, or removing one example changes the others' gradients and no "
                          "per-example clipping bounds its effect (batch statistics, in-batch negatives, a loss that "
                          "reads the other losses); compute each loss from its own example")
    raise Unsupported("the losses do not follow the batch's examples "
                      f"({'they come from no example' if value is None else value}): loss_fn must return one loss "
                      "per example, computed from that example's data, in the batch's order")


def _layout_of(track: Provenance, t):
    """A tensor argument's layout for torch.func's reading (None: shared by the examples, or no tensor)."""
    value = track.get(t) if isinstance(t, torch.Tensor) else None
    return value if isinstance(value, Layout) else None


def _front(t: torch.Tensor, layout, n: int) -> torch.Tensor:
    """``t`` with its examples first, (n, ...): the dimension that holds them split into (outer, n, inner)
    and n moved to the front (a view for a batch-first tensor and for rows flattened batch-first). The
    other dimensions keep their order, so an input and its output gradient moved alike still pair row
    with row."""
    if layout is None:
        return t
    if isinstance(layout, Rows):  # routed rows: each example's rows gathered, zero rows after (they add nothing)
        rows = layout.ids.repeat_interleave(layout.inner).to(t.device)
        order = torch.argsort(rows, stable=True)
        counts = torch.bincount(rows, minlength=n)
        slot = torch.arange(rows.numel(), device=t.device) - (torch.cumsum(counts, 0) - counts)[rows[order]]
        out = t.new_zeros(n, max(int(counts.max()), 1) if rows.numel() else 1, *t.shape[1:])
        out[rows[order], slot] = t[order]
        return out
    b, outer, inner = layout
    if (b, outer) == (0, 1):
        return t.reshape(n, inner, *t.shape[1:]) if inner != 1 else t
    return t.reshape(*t.shape[:b], outer, n, inner, *t.shape[b + 1:]).movedim(b + 1, 0)


def _fsdp_modules(model: nn.Module) -> list:
    """The modules of ``model`` sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module can be sharded (and none is loaded)
    kind = getattr(fsdp, "FSDPModule", None)
    return [] if kind is None else [m for m in model.modules() if isinstance(m, kind)]


def _fsdp_unsharded(modules: list) -> dict[int, nn.Parameter]:
    """Each FSDP2-sharded parameter's id -> the unsharded parameter its module holds from its forward to its
    backward (one object for the module's life, made by its first all-gather)."""
    found = {}
    for m in modules:
        for group in m._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                if hasattr(fp, "_unsharded_param"):
                    found[id(fp.sharded_param)] = fp._unsharded_param
    return found


class _ByAutograd:
    """The reading of one call of a layer without a registered function (``functional.per_example``):
    the call's arguments, detached, the element of a tuple output recorded, and the names of the
    parameters to read, relative to the layer (``PhantomClipping._reads``; ``_adopt`` adds those of
    sublayers its forward uses directly)."""

    def __init__(self, args: tuple, kwargs: dict, which: int | None, names: list[str], labels=None):
        self.args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        self.kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        self.which, self.names = which, names
        self.layouts = None  # where the examples are in each tensor of (args, kwargs), flattened (more than one example)
        if labels is not None:
            self.layouts = [labels(t) for t in tree_flatten((args, kwargs))[0]]

    def __call__(self, layer, x, g, n, g_layout=None):
        if not self.names:  # a host that adopted nothing: nothing to read
            return []
        return functional.per_example(layer, self.args, self.kwargs, g, n, self.which, self.names,
                                      self.layouts, g_layout)


@dataclass
class _Call:
    """One recorded call: its layer and the function that reads it, its input, the edge its output's
    gradient is read at, the output's (shape, dtype), the version counters that show an in-place change
    after the call, where the examples are in its input and output (``provenance.Layout``; None when the
    step has one example), the shape of an output every example shares (expanded over the batch), and what
    the guard needs (``guard.Call``)."""
    module: nn.Module
    fn: Callable
    x: torch.Tensor
    edge: Any
    meta: tuple
    versions: tuple
    layouts: tuple
    proof: guard.Call
    shared: tuple | None = None


class PhantomClipping:
    """Per-example gradient norms and their clipped sum for ``model`` (see the module's docstring)."""

    def __init__(self, model: nn.Module, C: float, *, rule: str = "classic", gamma: float = 0.01,
                 sum_by: str = "bookkeeping", form: str = "auto", check: str = "guard", stack: bool | None = None):
        if check in ("first", "always", "never"):
            raise ValueError(f"check {check!r} is gone: the guard now proves every step (no sampled self-check to "
                             "turn on or off); check='brute' adds a brute-force comparison on every step")
        for value, known, key in ((rule, RULES, "rule"), (sum_by, SUM_BY, "sum_by"), (form, FORMS, "form"),
                                  (check, CHECKS, "check")):
            if value not in known:
                raise ValueError(f"{key} {value!r} is unknown; known: {known}")
        if stack not in (None, True, False):
            raise ValueError(f"stack must be None (batched on CUDA only), True or False, got {stack!r}")
        if not 0 < C < float("inf"):
            raise ValueError(f"C must be a positive finite number, got {C!r}")
        if rule == "automatic" and not 0 < gamma < float("inf"):
            raise ValueError(f"gamma must be a positive finite number for the automatic rule, got {gamma!r}")
        self.model, self.C, self.rule, self.gamma = model, float(C), rule, float(gamma)
        # The provenance's dispatch mode imports torch._dynamo on its first operation (torch._compile); done
        # here, the import (1.6 s, 70 MB of the process's memory, once) is not inside the first step's
        # forward pass, where its frames kept that step's tensors (the logits among them) alive until the
        # garbage collector ran: the first step's peak, which the step benchmarks measured as Phantom's.
        import torch._dynamo  # noqa: F401
        self.sum_by, self.form, self.check = sum_by, form, check
        # same-shaped layers' norms and sums in batched products (uses.Stack): fewer launches where launches
        # bound the step (None: on CUDA only); on the CPU the stacked copies cost memory and time, and save nothing
        self.stack = stack
        self.params = {id(p): (name, p) for name, p in model.named_parameters(remove_duplicate=True) if p.requires_grad}
        self._names = {m: name for name, m in model.named_modules(remove_duplicate=True)}  # for messages
        self._parent = {child: m for m in self._names for child in m.children()}
        self.layers, self._how, self._reads = self._layers()
        self._holders = {pid: [self._names[m] for m, ps in self.layers.items() if any(id(p) == pid for p in ps)]
                         for pid in self.params}
        self._hints = {id(p): self._subclass_hint(m) for m, how in self._how.items() if how == "capture"
                       for p in self.layers[m]}
        self._calls: list[_Call] = []
        self._provenance: Provenance | None = None  # this forward pass's record of where the examples are
        self._losses_label: Any = None  # where the examples are in this forward pass's losses
        self._reading: dict = {}  # (layer, k-th call) on no example's data -> "rows" or "expand", as last proved right
        self._count: dict = {}  # this forward pass: calls per layer so far
        self._now: dict = {}  # this forward pass: the reading of each call on no example's data
        self._rows_possible: dict = {}  # ... and whether reading it row by row is possible at all
        self._active = False
        self._modes: list = []
        self._first: dict[nn.Module, int] = {}  # layer -> the id of the engine's recording hook, which must run first
        for module, how in self._how.items():
            if how == "capture":
                module.register_forward_pre_hook(self._enter)
                module.register_forward_hook(self._leave, always_call=True)
            if how != "capture" or self._reads.get(module):
                # first of the layer's forward hooks: what a user's hook does to the output is outside the call
                self._first[module] = module.register_forward_hook(self._record, with_kwargs=True, prepend=True).id
        self._registered = [m for m, how in self._how.items() if callable(how)]  # read by a registered function
        # FSDP2 (fully_shard): the modules hold sharded parameters at rest and unsharded ones (other objects) from
        # their forward to their backward; a step keys every table by the unsharded ones (``_bind``)
        self._fsdp = _fsdp_modules(model)
        if self._fsdp and sum_by != "backward":
            raise Unsupported("a model sharded by FSDP2 (fully_shard) needs sum_by='backward': the clipped sum then "
                              "flows through FSDP's own backward and reduce-scatter into the sharded gradients")
        self._rest: tuple | None = None  # the tables keyed by the parameters at rest, while a step is bound
        self._alias: dict[int, int] = {}  # while bound: a sharded or unsharded parameter's id -> the table's key
        self._statistics = [m for m in self._names if isinstance(m, BATCH_STATISTICS)]

    def _subclass_hint(self, module: nn.Module) -> str:
        """What the guard says of a subclass read at its base's functional call whose forward computed
        with its parameters another way."""
        base, fn, _ = functional.base_of(module)
        return (f"{self._names[module]} is a {type(module).__name__}, a subclass of nn.{base.__name__} read where its "
                f"forward calls F.{fn.__name__} on its weight, and it computed with its parameters another way "
                f"(input @ weight.T, weight[ids]); register a function for {type(module).__name__} "
                "(pipeline.clipping.register)")

    def ties(self) -> dict[str, list[str]]:
        """Each trainable parameter held by more than one layer, with those layers' names (found by
        identity: ``{'transformer.wte.weight': ['transformer.wte', 'lm_head']}`` for GPT-2)."""
        return {self.params[pid][0]: held for pid, held in self._holders.items() if len(held) > 1}

    def _layers(self) -> tuple[dict[nn.Module, list[nn.Parameter]], dict[nn.Module, Any], dict[nn.Module, list[str]]]:
        """The layers holding the trainable parameters; how each is read: its registered function,
        ``"capture"`` (a subclass of a registered type, read at its base's functional call),
        ``"autograd"`` (any other layer, by torch.func) or ``"host"`` (a module whose parameters are all
        held by layers inside it: read by torch.func for what ``_adopt`` gives it); and for the layers
        torch.func reads, the names of the parameters it reads (an autograd layer's own; a subclass's
        that its base's call does not take; a host's none). Unsupported: a layer that mixes the
        examples of a batch, an embedding whose gradient is scaled by the batch's counts, a parametrized
        layer. A BatchNorm is read by torch.func, and refused on a step on which it uses the batch's statistics
        (``_refuse_unseen``)."""
        holders: dict[int, list[nn.Module]] = {}
        for module in self._names:
            for _, p in module.named_parameters(recurse=False):
                holders.setdefault(id(p), []).append(module)
        found: dict[nn.Module, list[nn.Parameter]] = {}
        how: dict[nn.Module, Any] = {}
        reads: dict[nn.Module, list[str]] = {}
        for module, name in self._names.items():
            own = [(k, p) for k, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            inside = set(module.modules()) - {module}
            if all(any(h in inside for h in holders[id(p)]) for _, p in own):
                # each is also held by a layer inside it (BERT's head's bias is its decoder's): counted there. The
                # module is still read by torch.func, for nothing of its own: a sublayer it uses without calling
                # it (MobileBERT's head multiplies by its decoder's weight) is read with it (``_adopt``)
                found[module], how[module], reads[module] = [], "host", []
                continue
            held = [f"{name}.{k}" if name else k for k, _ in own]
            if isinstance(module, parametrize.ParametrizationList):
                layer, _, tensor = name.rpartition(".parametrizations.")
                raise Unsupported(f"layer {layer or '(the model)'} is parametrized (torch.nn.utils.parametrize, as "
                                  f"weight_norm, spectral_norm and orthogonal do): its {tensor} is computed from the "
                                  f"trainable {held} on every access, and the engine gives no per-example gradient "
                                  "through a parametrization; remove it (torch.nn.utils.parametrize."
                                  f"remove_parametrizations(layer, {tensor!r})) or freeze its originals "
                                  "(requires_grad=False)")
            if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
                raise Unsupported(f"layer {name} (nn.Embedding) has scale_grad_by_freq=True: each example's gradient "
                                  "is scaled by the counts of the whole batch, so it is no per-example gradient")
            fn = lookup(module)
            if fn is None:  # a subclass of a registered type is read at its base's call; anything else by torch.func
                fn = "capture" if functional.base_of(module) is not None else "autograd"
            if fn == "capture":  # parameters the base's call does not take (a scale of its own) read by torch.func
                reads[module] = [k for k, _ in own if k not in ("weight", "bias")]
            elif fn == "autograd":
                reads[module] = [k for k, _ in own]
            found[module], how[module] = [p for _, p in own], fn
        return found, how, reads

    # --- recording ------------------------------------------------------------------------------

    def _record(self, module, args, kwargs, output):
        """The forward hook of a registered or autograd-read layer. A layer read by torch.func may return
        a tuple (an attention's output and its weights): its first tensor with a gradient is recorded, and
        a use through the others is a path the guard refuses."""
        if not (self._active and torch.is_grad_enabled()):
            return None
        fn, which = self._how[module], None
        fn = "autograd" if fn in ("host", "capture") else fn
        if fn == "autograd" and isinstance(output, (tuple, list)):
            which = next((k for k, o in enumerate(output) if isinstance(o, torch.Tensor) and o.requires_grad), None)
        out = output if which is None else output[which]
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return None
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if not tensors:
            if self._how[module] == "host":
                return None  # nothing of its own to read: its sublayers' calls are recorded (or refused) on their own
            raise Unsupported(f"layer {self._names[module] or '(the model)'} was called with no tensor argument, so its "
                              "output does not come from the batch's examples: every example shares it, and its "
                              "gradient is the examples' sum, not one example's; call it on a batch-first input (the "
                              "indices it reads, expanded over the batch) or freeze its parameters (requires_grad=False)")
        x = args[0] if args and isinstance(args[0], torch.Tensor) else tensors[0]
        if fn == "autograd":
            track = self._provenance
            labels = None if track is None else (lambda t: _layout_of(track, t))
            fn = _ByAutograd(args, kwargs, which, self._reads[module], labels)
            if track is not None:  # the input that carries the examples
                x = next((t for t in tensors if isinstance(track.get(t), Layout)), x)
        noted = self._note(module, x, out, fn, tensors)
        if noted is out:
            return None
        return noted if which is None else type(output)((*output[:which], noted, *output[which + 1:]))

    def _enter(self, module, args):
        if self._active and torch.is_grad_enabled():
            mode = functional.Capture(module, self._note)
            mode.__enter__()
            self._modes.append((module, mode))

    def _leave(self, module, args, output):
        if self._modes and self._modes[-1][0] is module:
            self._modes.pop()[1].__exit__(None, None, None)

    def _note(self, module, x: torch.Tensor, output: torch.Tensor, fn: Callable, tensors: list) -> torch.Tensor:
        """Record one call; return the output the model goes on with (expanded over the batch where the
        call ran on no example's data).

        Where the examples are in the call's input and output is read from the step's provenance
        (``provenance.py``): from how each tensor was computed from the batch, never from its shape. An
        output that mixes the examples, or an input that does, is refused here. A call on no example's data
        (positions ``wpe(torch.arange(T))``, a (1, T) table) makes an output that every example shares:
        it is expanded over the batch (a leading size 1 to n, or a new leading dimension of n), so that
        each example's output gradient exists, and labelled ``Shared``: the provenance refuses any use of
        it but an elementwise one whose result the expansion does not change (``h + wpe(pos)``).

        The output is kept as its gradient edge (the autograd node that made it), not as a tensor: the
        gradient is asked for at that edge, so the output's memory (a language model's logits, B x T x V)
        is freed as in a plain step, and an in-place change of the output after the call (ReLU(inplace=True),
        out.mul_(10)) does not move the gradient read: it is the one at the layer's output as made. An
        output that is a view (nn.Linear and Conv1D on a (n, T, d) input return their 2-D product reshaped)
        is read at its base's edge: an in-place change of a view re-routes the gradient around the view's
        own node (autograd's CopySlices), to the base's. A partial view is held, with its version counter,
        and refused if changed in place. The input's version counter: an in-place change of the input after
        the call would make the values read other than the ones the layer used."""
        name = self._names.get(module) or "(the model)"
        track, shared = self._provenance, None
        layouts = (None, None)
        if track is not None:
            xv, ov = track.get(x), track.get(output)
            for value, which in ((ov, "output"), (xv, "input")):
                if isinstance(value, Mixed):
                    track._retry(track.guesses(output if which == "output" else x),
                                 f"the {which} of {name} mixes the examples ({value.why})")
                    raise Unsupported(f"the {which} of {name} mixes the examples of the batch ({value.why}): each "
                                      "example's gradient would depend on the other examples, and no per-example "
                                      "clipping bounds one example's effect; compute each example's values from its "
                                      "own data only")
                if isinstance(value, Shared):
                    raise track._misused(value, f"layer {name}")
                if isinstance(value, Part):
                    raise Unsupported(f"the {which} of {name} holds some of the examples (a chunk of the batch, "
                                      f"x[{value.start}:{value.stop}]): the engine records a layer's call on the "
                                      "whole batch; call the layer on the whole batch and chunk around it")
            if ov is None:
                if any(track.get(t) is not None for t in tensors):
                    raise Unsupported(f"the output of {name} does not follow the examples of its input: the engine "
                                      "cannot tell which example each of its rows belongs to")
                n = track.n
                key = (module, self._count.get(module, 0))
                self._count[module] = key[1] + 1
                rows = bool(not isinstance(fn, _ByAutograd) and output.dim() and output.shape[0] == n)
                self._rows_possible[key] = rows
                reading = self._now[key] = self._reading.get(key, "rows" if rows else "expand")
                if reading == "rows":
                    # public rows laid out per example (positions already expanded over the batch, a zero initial
                    # state): read as batch first, a hypothesis every later operation checks (a contradiction
                    # raises Retry, and the forward pass runs again with the output expanded instead)
                    track.label(output, Layout(0), frozenset({key}))
                    layouts = (Layout(0), Layout(0))
                else:
                    shared = tuple(output.shape)
                    if output.dim() and output.shape[0] == 1 and x.dim() and x.shape[0] == 1:
                        output, x = output.expand(n, *output.shape[1:]), x.expand(n, *x.shape[1:])
                    else:
                        output, x = output.unsqueeze(0).expand(n, *output.shape), x.unsqueeze(0).expand(n, *x.shape)
                    track.label(output, Shared(Layout(0), shared, name, key))
                    layouts = (Layout(0), Layout(0))
            else:
                if isinstance(fn, _ByAutograd):
                    if any(isinstance(track.get(t), (Rows, Positions)) for t in tensors) or isinstance(ov, Rows):
                        raise Unsupported(f"layer {name} has no registered function and was called on rows routed by "
                                          "the data (a mixture of experts' tokens): the engine reads routed rows only "
                                          "through registered layers; register a function for it, or freeze it")
                    xv = xv if isinstance(xv, Layout) else ov
                elif xv != ov:
                    raise Unsupported(f"the examples are laid out differently in the input ({xv}) and the output "
                                      f"({ov}) of {name}, whose registered function reads them row by row; call it "
                                      "on a tensor laid out as its output")
                layouts = (xv, ov)
        held, version = None, None
        base = output._base if output._is_view() and shared is None else None
        if base is None:
            edge = get_gradient_edge(output)
        elif _plain_reshape(output, base, x):
            edge = get_gradient_edge(base)
        else:
            edge, held, version = output, output, output._version
        proof = _pair(edge if held is None else get_gradient_edge(output))
        inputs = frozenset(_pair(get_gradient_edge(t)) for t in tensors if t.requires_grad)
        own = frozenset(id(p) for p in self.layers[module])
        self._calls.append(_Call(module, fn, x.detach(), edge, (output.shape, output.dtype),
                                 (x._version, held, version), layouts, guard.Call(name, proof, inputs, own), shared))
        return output

    # --- the two passes -----------------------------------------------------------------------

    def _bind(self) -> None:
        """FSDP2: key the step's tables (parameters, layers, holders) by the unsharded parameters the forward
        pass used (the autograd graph's leaves), each sharded one's by its name; ``_unbind`` puts the tables
        at rest back. Without FSDP, nothing."""
        if not self._fsdp:
            return
        unsharded = _fsdp_unsharded(self._fsdp)
        self._rest = (self.params, self.layers, self._holders, self._hints)
        now = {pid: unsharded.get(pid, p) for pid, (_, p) in self.params.items()}
        self._alias = {**{pid: id(q) for pid, q in now.items()}, **{id(q): id(q) for q in now.values()}}
        self.params = {id(now[pid]): (name, now[pid]) for pid, (name, _) in self._rest[0].items()}
        self.layers = {m: [now[id(p)] for p in ps] for m, ps in self._rest[1].items()}
        self._holders = {id(now[pid]): held for pid, held in self._rest[2].items()}
        self._hints = {id(now[pid]): hint for pid, hint in self._rest[3].items() if pid in now}

    def _unbind(self) -> None:
        if self._rest is not None:
            self.params, self.layers, self._holders, self._hints = self._rest
            self._rest, self._alias = None, {}

    def _uses(self, losses: torch.Tensor, keep_graph: bool) -> dict[int, list[Use]]:
        """Every recorded call's uses, by parameter id, from one gradient pass to the layers' outputs,
        once the guard has proved that no other use exists."""
        calls, self._calls = self._calls, []
        if not calls:
            raise Unsupported("the loss depends on no layer of the model that holds a trainable parameter")
        names = self._names
        for call in calls:
            version, held, held_version = call.versions
            if call.x._version != version or (held is not None and held._version != held_version):
                which = "input" if call.x._version != version else "output (a partial view)"
                raise Unsupported(f"the {which} of {call.proof.name} was changed in place after the call "
                                  "(x.mul_(...)): the engine would read other values than the layer used; make that "
                                  "operation out of place")
        n = losses.shape[0]
        self._bind()
        if self._alias:
            for call in calls:
                call.proof.own = frozenset(self._alias.get(pid, pid) for pid in call.proof.own)
        self._adopt(calls)
        guard.prove(_pair(get_gradient_edge(losses)), [c.proof for c in calls], self.params, self._holders, self._hints)
        _examples_apart(self._losses_label)
        grads = torch.autograd.grad(losses.sum(), [c.edge for c in calls], retain_graph=keep_graph, allow_unused=True)
        uses: dict[int, list[Use]] = {}
        given: dict[nn.Module, set[int]] = {}
        for call, g in zip(calls, grads):
            shape, dtype = call.meta
            g = torch.zeros(shape, dtype=dtype, device=call.x.device) if g is None else g.reshape(shape)
            x, g = _wide(call.x), _wide(g.detach())
            x_layout, g_layout = call.layouts
            if call.shared is not None:  # (n, *the shared output's shape): example i's gradient of it
                g = g.reshape(n, *call.shared)
            if isinstance(call.fn, _ByAutograd):
                found = call.fn(call.module, x, g, n, None if call.shared is not None else g_layout)
            else:
                found = call.fn(call.module, _front(x, x_layout, n), _front(g, g_layout, n), n)
            found = [(None if p is None else self._alias.get(id(p), id(p)), use) for p, use in found]
            given.setdefault(call.module, set()).update(pid for pid, _ in found if pid is not None)
            for pid, use in found:
                if pid is not None and pid in self.params:
                    uses.setdefault(pid, []).append(use)
        for module, got in given.items():
            missing = {id(p) for p in self.layers[module]} - got
            if missing:  # a layer function that leaves out a parameter would count it as zero
                left = [self.params[pid][0] for pid in missing if pid in self.params]
                raise Unsupported(f"the function registered for {names.get(module, type(module).__name__)} gives no "
                                  f"per-example gradient for its trainable {left} (a parametrisation such as "
                                  "weight_norm?): register one that gives every parameter the layer holds")
        return {pid: merged(found) for pid, found in uses.items()}

    def _stacks(self, uses: dict[int, list[Use]]) -> tuple[list[tuple[list[int], Stack]], list[int]]:
        """The parameters of one use each, grouped by ``stack_key`` into batched computations (groups of
        two or more), and the rest (tied and reused-in-two-ways parameters, with their cross terms; lookups;
        a shape of its own), served one by one."""
        keyed: dict[tuple, list[int]] = {}
        alone: list[int] = []
        for pid, found in uses.items():
            key = stack_key(found[0], _shape(self.params[pid][1]), self.form) if len(found) == 1 else None
            if key is not None and not (self.stack if self.stack is not None else key[-1].type == "cuda"):
                key = None
            (keyed.setdefault(key, []) if key is not None else alone).append(pid)
        stacks = []
        for key, pids in keyed.items():
            if len(pids) == 1:
                alone.extend(pids)
            else:
                stacks.append((pids, Stack.of([uses[pid][0] for pid in pids], key)))
        return stacks, alone

    def _adopt(self, calls: list[_Call]) -> None:
        """A layer not called in this forward pass whose parameters its parent uses directly (Mamba's
        mixer reads its ``conv1d.weight``, never calling the conv): each such layer's parameters join the
        torch.func reading of the nearest enclosing layer that was called and is read that way, which
        then accounts for every use inside its calls (a use elsewhere is a path the guard refuses)."""
        called = {c.module for c in calls}
        silent = [m for m in self.layers if m not in called]
        if not silent:
            return
        by_module: dict[nn.Module, list[_Call]] = {}
        for c in calls:
            if isinstance(c.fn, _ByAutograd):
                by_module.setdefault(c.module, []).append(c)
        for layer in silent:
            up = self._parent.get(layer)
            while up is not None and up not in by_module:
                up = self._parent.get(up)
            if up is None:
                continue  # no enclosing call reads it: any use is one the guard refuses
            prefix = self._names[layer][len(self._names[up]) + 1 if self._names[up] else 0:]
            names = [f"{prefix}.{k}" for k, p in layer.named_parameters(recurse=False) if p.requires_grad]
            for c in by_module[up]:
                c.fn.names = c.fn.names + names
                c.proof.own = c.proof.own | {id(p) for p in self.layers[layer]}

    def _sq_norms(self, uses: dict[int, list[Use]], n: int, stacks=None) -> dict[int, torch.Tensor]:
        """Each parameter's per-example squared gradient norms, (n,), by parameter id."""
        stacks, alone = stacks or self._stacks(uses)
        per: dict[int, torch.Tensor] = {}
        for pids, stack in stacks:
            for pid, sq in zip(pids, stack.sq_norms()):
                per[pid] = sq
        for pid in alone:
            found = uses[pid]
            shape = _shape(self.params[pid][1])
            sq = 0
            for use in found:
                sq = sq + inner(use, use, n, shape, self.form)
            for a in range(len(found)):
                for b in range(a + 1, len(found)):  # the cross terms of a parameter used in two ways
                    sq = sq + 2 * inner(found[a], found[b], n, shape, self.form)
            per[pid] = sq
        return per

    @staticmethod
    def _total(per: dict[int, torch.Tensor], losses: torch.Tensor) -> torch.Tensor:
        """The whole model's per-example norms: the parameters' squared norms summed in one operation."""
        dtype = torch.float64 if losses.dtype == torch.float64 else torch.float32
        return torch.stack([sq.to(dtype) for sq in per.values()]).sum(0).clamp(min=0).sqrt()

    def per_example_norms(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any):
        """(losses, norms): each (n,), the norms of the whole model's per-example gradients; no
        parameter gradient is formed or changed."""
        losses = self._forward(loss_fn, batch)
        try:
            uses = self._uses(losses, keep_graph=False)
            return losses.detach(), self._total(self._sq_norms(uses, losses.shape[0]), losses)
        finally:
            self._unbind()

    def step(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any):
        """(losses, norms), and every trainable parameter's ``.grad`` set to the clipped sum
        sum_i c_i g_i (replacing what was there). A model sharded by FSDP2: the sum flows through FSDP's
        backward (``sum_by="backward"``), whose reduce-scatter adds it into the sharded ``p.grad``: the sum
        over the ranks' examples, with the modules' gradient divide factor 1."""
        if self._fsdp:  # FSDP adds into a sharded gradient already there
            for _, p in self.params.values():
                p.grad = None
        try:
            losses, norms = self._step(loss_fn, batch)
        finally:
            self._unbind()
        for _, p in self.params.values():  # a parameter the batch did not reach: a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return losses, norms

    def _step(self, loss_fn, batch):
        brute = self.check == "brute"
        rng = self._rng_states() if brute else None  # the brute force's forward pass draws the same dropout
        losses = self._forward(loss_fn, batch)
        uses = self._uses(losses, keep_graph=self.sum_by == "backward")
        n = losses.shape[0]
        stacks = self._stacks(uses)
        per = self._sq_norms(uses, n, stacks)
        norms = self._total(per, losses)
        c = coefficients(norms, C=self.C, rule=self.rule, gamma=self.gamma).detach()
        for _, p in self.params.values():
            p.grad = None
        if self.sum_by == "bookkeeping":
            self._bookkeeping(uses, c, stacks)
        # The output gradients (the logits', B x T x V, among them) are not held through the second backward
        # pass or the brute force: a step's peak memory stays about that of a plain step's backward.
        del uses, stacks
        if self.sum_by == "backward":
            (c.to(losses.dtype) * losses).sum().backward()
        if brute:
            try:
                self._brute(loss_fn, batch, per, rng)
            except BaseException:
                for _, p in self.params.values():  # no unchecked sum is left behind (a refusal, an error, Ctrl-C)
                    p.grad = None
                raise
        return losses.detach(), norms

    def _bookkeeping(self, uses: dict[int, list[Use]], c: torch.Tensor, stacks) -> None:
        """``p.grad = sum_i c_i G_i`` from the recorded factors, a stack's k sums in one batched product
        (a function of its own: no loop variable keeps a use, and with it an output gradient, alive after it)."""
        stacked, alone = stacks
        for pids, stack in stacked:
            for pid, grad in zip(pids, stack.weighted_sums(c)):
                p = self.params[pid][1]
                p.grad = grad.reshape(p.shape).to(p.dtype)
        for pid in alone:
            p = self.params[pid][1]
            grad = None
            # a tied table's uses added into the first's sum (a new tensor: uses.py), lookups last and in place
            for use in sorted(uses[pid], key=lambda u: isinstance(u, Outer) and u.index):
                if (grad is not None and isinstance(use, Outer) and use.index and grad.dtype == use.right.dtype
                        and tuple(grad.shape) == (use.rows, use.right.shape[-1])):
                    use.add_weighted_sum(c, grad)
                    continue
                part = use.weighted_sum(c)
                same = grad is not None and part.dtype == grad.dtype and part.shape == grad.shape
                grad = part if grad is None else grad.add_(part) if same else grad + part
            p.grad = grad.reshape(p.shape).to(p.dtype)

    def add_noise(self, multiplier: float, generator: torch.Generator | None = None) -> None:
        """The Gaussian mechanism on the clipped sum: N(0, (multiplier C)^2) added to every ``p.grad``.
        Each example's clipped gradient has norm at most C (both rules), so adding or removing one
        example moves the sum by at most C: the sensitivity the multiplier is calibrated for
        (``pipeline.privacy.dpsgd_noise_multiplier`` under Poisson sampling)."""
        from pipeline.dpsgd.noise import add_noise  # DP-SGD's one noise step (it imports no engine)

        add_noise([p for _, p in self.params.values()], multiplier, self.C, generator)

    def _forward(self, loss_fn, batch) -> torch.Tensor:
        now = {id(p) for p in self.model.parameters() if p.requires_grad}
        if now != set(self.params):  # unfrozen, frozen, resized or re-tied since the engine was made
            raise Unsupported("the model's trainable parameters changed since the engine was made (a layer "
                              "unfrozen or frozen, an embedding resized or re-tied): make a new PhantomClipping")
        self._refuse_unseen()
        n = _batch_size(batch)
        if n is None:
            raise Unsupported(f"the batch ({type(batch).__name__}) holds no tensor the engine can find: give the "
                              "examples as a tensor, or a tuple, list or dict of tensors, batch first")
        tried: dict = {}  # call -> the readings tried on this step

        def may_retry(key) -> bool:  # the other reading of a call on no example's data is still untried
            return len(tried.setdefault(key, {self._now[key]})) < 2 and (
                self._now[key] == "rows" or self._rows_possible.get(key, False))

        rng = self._rng_states() if n > 1 else None
        reasons: list = []  # why each retried reading was contradicted
        while True:
            track = None
            if n > 1:  # with one example, every row of every tensor is that example's
                owned = {id(t) for t in self.model.parameters()} | {id(t) for t in self.model.buffers()}
                track = Provenance(n, owned, may_retry)
                track.mark(batch)
            self._calls, self._active, self._provenance, self._count, self._now = [], True, track, {}, {}
            torch.Tensor.register_hook = _refuse_gradient_hook
            try:
                if track is None:
                    losses = loss_fn(self.model, batch)
                else:
                    with track:
                        losses = loss_fn(self.model, batch)
                    if track.get(losses) != Layout(0):
                        track._retry(track.guesses(losses), f"the losses are {track.get(losses)}")
                break
            except (Refusal, Unsupported) as refusal:
                if not reasons:
                    if isinstance(refusal, Unsupported):
                        raise
                    raise Unsupported(str(refusal)) from None
                (layer, _), was, why = reasons[0]
                other = "expanded over the batch" if was == "rows" else "read row by row, as batch first"
                raise Unsupported(f"{refusal} (with the output of {self._names.get(layer)} {other} instead: "
                                  f"{why})") from None
            except Retry as retry:  # the reading guessed for a call was contradicted: the other one, from the top
                was = self._now[retry.key]
                reasons.append((retry.key, was, retry.why))
                self._reading[retry.key] = "expand" if was == "rows" else "rows"
                tried.setdefault(retry.key, set()).update({was, self._reading[retry.key]})
                self._restore(rng)
            except Exception as error:
                expanded = [self._names.get(key[0]) for key, how in self._now.items() if how == "expand"]
                if track is None or not expanded:
                    raise
                raise Unsupported(f"the forward pass failed ({type(error).__name__}: {str(error).splitlines()[0]}) "
                                  f"with the output of {', '.join(expanded)}, called on no example's data, expanded "
                                  "over the batch by the engine to read each example's gradient of it; use it only "
                                  "in an elementwise operation with the examples' data, compute it from a "
                                  "batch-first input, or freeze the layer's parameters") from error
            finally:
                torch.Tensor.register_hook = _REGISTER_HOOK
                self._active, self._provenance = False, None
                while self._modes:  # a forward pass that raised inside a subclassed layer
                    self._modes.pop()[1].__exit__(None, None, None)
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            self._calls = []
            raise ValueError(f"loss_fn must return the (n,) per-example losses, got "
                             f"{tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__}")
        if losses.shape[0] != n:
            self._calls = []
            raise Unsupported(f"the batch's first tensor has {n} rows and loss_fn returned {losses.shape[0]} losses: "
                              "one loss per example, batch first (the examples' tensors first in the batch)")
        # where the examples are in the losses: refused after the guard's proof (``_examples_apart``), so that an
        # unseen use of a weight is named as such first
        self._losses_label = Layout(0) if track is None else track.get(losses)
        return losses

    def _refuse_unseen(self) -> None:
        """Before each forward pass: what would change a layer's call, or the gradients, where the engine cannot
        see it. A BatchNorm on the batch's statistics (training mode, or no running statistics) mixes the
        examples; a global forward hook runs before the engine records a call, and so does a layer's hook put
        before the engine's (``prepend=True``); a ``forward`` set on an instance of a type whose registered
        function assumes the type's own; module backward hooks and a trainable parameter's gradient hooks rewrite
        gradients. Forward pre-hooks change a call's input, which is recorded as the layer received it, and a
        layer's forward hooks after the engine's act on its output outside the call (as graph the guard walks)."""
        for module in self._statistics:
            if module.training or module.running_mean is None:
                held = [f"{self._names[module]}.{k}" if self._names[module] else k
                        for k, p in module.named_parameters(recurse=False) if p.requires_grad]
                kind = f"{type(module).__module__}.{type(module).__qualname__}"
                raise Unsupported(f"layer {self._names[module] or '(the model)'} ({kind}) mixes the examples of a batch: "
                                  "it normalises each example by the batch's statistics (training mode"
                                  f"{'' if module.track_running_stats else ', no running statistics'}), so one "
                                  "example's loss depends on every other example and no per-example gradient bounds "
                                  f"its effect{f' (it holds the trainable {held})' if held else ''}; put it in eval "
                                  "mode with running statistics (layer.eval()) or use a per-example normalisation "
                                  "(LayerNorm, GroupNorm)")
        for hooks, kind in ((torch_module._global_forward_hooks, "forward hook"),
                            (torch_module._global_backward_hooks, "backward hook"),
                            (torch_module._global_backward_pre_hooks, "backward pre-hook")):
            if hooks:
                raise Unsupported(f"a global module {kind} is registered ({_name_of(next(iter(hooks.values())))}, "
                                  f"torch.nn.modules.module.register_module_{kind.replace(' ', '_')}): it runs on every "
                                  "layer's call before the engine records it, or rewrites the gradients the engine reads; "
                                  "remove it while training with the engine")
        for module, first in self._first.items():
            for key, hook in module._forward_hooks.items():
                if key == first:
                    break
                if not isinstance(getattr(hook, "__self__", None), PhantomClipping):  # another engine's: idle
                    raise Unsupported(f"layer {self._names[module] or '(the model)'} has a forward hook "
                                      f"({_name_of(hook)}) that runs before the engine records the call (registered "
                                      "with prepend=True after the engine was made): its change of the output would "
                                      "be read as the layer's own; register it without prepend=True")
        for module in self._registered:
            if "forward" in vars(module):
                raise Unsupported(f"layer {self._names[module] or '(the model)'} ({type(module).__name__}) has a forward "
                                  f"set on the instance ({_name_of(vars(module)['forward'])}), and the function "
                                  f"registered for {type(module).__name__} assumes the type's own forward; subclass it "
                                  "instead (a subclass of nn.Linear or nn.Embedding is read at its F.linear or "
                                  "F.embedding call), or register a function for a type of your own")
        for module, name in self._names.items():
            if module._backward_hooks or module._backward_pre_hooks:
                hook = next(iter({**module._backward_pre_hooks, **module._backward_hooks}.values()))
                raise Unsupported(f"module {name or '(the model)'} has a backward hook ({_name_of(hook)}, "
                                  "register_full_backward_hook): it may rewrite the gradients the engine reads and sums; "
                                  "remove it while training with the engine")
        for name, p in self.params.values():
            if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
                raise Unsupported(f"parameter {name} has a gradient hook (register_hook or "
                                  "register_post_accumulate_grad_hook): it would rewrite the clipped sum (or be skipped, "
                                  "when the sum is formed by book-keeping); remove it while training with the engine")

    def _restore(self, rng: tuple) -> None:
        """Put the random states of ``_rng_states`` back: a forward pass run again draws the same dropout."""
        cpu, cuda, py, npy = rng
        torch.set_rng_state(cpu)
        for d, state in cuda.items():
            torch.cuda.set_rng_state(state, d)
        random.setstate(py)
        np.random.set_state(npy)

    def _rng_states(self) -> tuple:
        """The random states a forward pass draws from (the CPU's and each CUDA device's of the
        model, Python's and NumPy's global ones): the brute force's own forward pass is run from them, so its
        dropout masks are the step's, and they are put back after it (a checked step leaves the streams as an
        unchecked one). A model that draws from a generator of its own, or whose forward changes its state,
        gives the brute force another forward pass than the step's."""
        devices = sorted({p.device.index or 0 for _, p in self.params.values() if p.device.type == "cuda"})
        return (torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices}, random.getstate(),
                np.random.get_state())

    def _brute(self, loss_fn, batch, per: dict[int, torch.Tensor], rng: tuple) -> None:
        """``check="brute"``: each parameter's per-example norms against one backward pass per example, on
        a forward pass of its own (no hook records it) from the step's random states, after the step's graph
        is freed. The guard has proved that every use was recorded, so a difference is a layer function
        that is wrong for its layer. The tolerance is rounding's, 16 eps sqrt(m) relative (m the model's
        trainable numbers, eps its dtype's), with a floor of its square times the example's whole squared
        norm (a parameter whose true gradient is zero, a key projection's bias, carries rounding residues)."""
        names, params = zip(*self.params.values())
        after = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=list(rng[1])):
            self._restore(rng)
            try:
                losses = loss_fn(self.model, batch)
            finally:
                random.setstate(after[0])
                np.random.set_state(after[1])
        terms = sum(p.numel() for p in params)
        rtol = functional.rounding(params[0].dtype, terms)
        for i in range(losses.shape[0]):
            truth = torch.autograd.grad(losses[i], params, retain_graph=i + 1 < losses.shape[0], allow_unused=True)
            wants = [0.0 if want is None else float(want.double().pow(2).sum()) for want in truth]
            floor = rtol ** 2 * sum(wants)
            for name, p, want_sq in zip(names, params, wants):
                have_sq = float(per[id(p)][i]) if id(p) in per else 0.0
                if abs(have_sq - want_sq) > max(rtol * max(want_sq, have_sq), floor):
                    kinds = sorted({type(m).__name__ for m, ps in self.layers.items() if any(q is p for q in ps)})
                    raise Unsupported(
                        f"parameter {name}: the function registered for {', '.join(kinds)} gives example {i} a squared "
                        f"gradient norm of {have_sq:.6g}, one backward pass gives {want_sq:.6g} (tolerance {rtol:.1e}, "
                        f"from {p.dtype} and {terms} parameters): the layer function is wrong for this layer, or the "
                        "layer's forward is not what it assumes; fix the function or register the right one")
