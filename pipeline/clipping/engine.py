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
At construction: a layer that mixes the examples of a batch (BatchNorm) or scales an embedding's
gradient by the batch's counts. Layers without a registered function are read exactly all the same
(``functional.py``): subclasses of ``nn.Embedding`` and ``nn.Linear`` at their base's functional
call, every other layer by ``torch.func`` (its per-example gradients materialised: register a
function for a large matrix), each checked to add up to the batch's gradient. A layer called on a batch of one broadcast over the examples (Hugging Face's default
(1, T) position ids) has its output expanded over the batch in the forward pass, so that each
example's output gradient exists; rows flattened from a batch-first tensor ((n T, d), OPT's
feed-forward) are mapped back to their examples. A parameter held by a layer and by a module around
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
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.nn.modules import module as torch_module  # torch's global module hooks
from torch.nn.utils import parametrize

from pipeline.clipping import functional, guard
from pipeline.clipping.guard import Unsupported
from pipeline.clipping.layers import lookup
from pipeline.clipping.uses import Stack, Use, inner, merged, stack_key

RULES = ("classic", "automatic")
CHECKS = ("guard", "brute")
SUM_BY = ("bookkeeping", "backward")
FORMS = ("auto", "gram", "direct")
BATCH_STATISTICS = nn.modules.batchnorm._BatchNorm  # in training mode (or without running statistics): examples mix
FLAT_DEPTH = 8  # graph nodes walked back from a layer's (n T, d) input to the batch-first tensor it was flattened from


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
    """The leading size of the first tensor in the batch (any nesting of tuples, lists and dicts): the
    number of examples, by the engine's batch-first contract."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = _batch_size(item)
        if found is not None:
            return found
    return None


_REGISTER_HOOK = torch.Tensor.register_hook


def _name_of(hook) -> str:
    """A hook's name for a message: its qualified name, or its type's."""
    return getattr(hook, "__qualname__", None) or getattr(getattr(hook, "func", None), "__qualname__", None) \
        or type(hook).__qualname__


def _refuse_gradient_hook(tensor: torch.Tensor, hook: Callable):
    """``Tensor.register_hook`` while the engine runs a forward pass: a hook on an intermediate gradient can
    rewrite what the engine reads (a division by the batch's gradient norm mixes the examples), and the
    autograd graph does not show it to the guard: refused where it is registered."""
    raise Unsupported(f"a gradient hook ({_name_of(hook)}) was registered on a tensor during the forward pass "
                      "(tensor.register_hook): it can rewrite the gradients the engine reads, mixing the examples or "
                      "scaling one of them, and no per-example bound then holds; remove it while training with the "
                      "engine")


class _ByAutograd:
    """The reading of one call of a layer without a registered function (``functional.per_example``):
    the call's arguments, detached, the element of a tuple output recorded, and the names of the
    parameters to read, relative to the layer (``PhantomClipping._reads``; ``_adopt`` adds those of
    sublayers its forward uses directly)."""

    def __init__(self, args: tuple, kwargs: dict, which: int | None, names: list[str]):
        self.args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        self.kwargs = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        self.which, self.names = which, names

    def __call__(self, layer, x, g, n):
        if not self.names:  # a host that adopted nothing: nothing to read
            return []
        return functional.per_example(layer, self.args, self.kwargs, g, n, self.which, self.names)


@dataclass
class _Call:
    """One recorded call: its layer and the function that reads it, its input, the edge its output's
    gradient is read at, the output's (shape, dtype), the version counters that show an in-place change
    after the call, the leading size of the batch-first tensor its rows were flattened from (if they
    were), and what the guard needs (``guard.Call``)."""
    module: nn.Module
    fn: Callable
    x: torch.Tensor
    edge: Any
    meta: tuple
    versions: tuple
    lead: int | None
    proof: guard.Call
    broadcast: bool = False


class PhantomClipping:
    """Per-example gradient norms and their clipped sum for ``model`` (see the module's docstring)."""

    def __init__(self, model: nn.Module, C: float, *, rule: str = "classic", gamma: float = 0.01,
                 sum_by: str = "bookkeeping", form: str = "auto", check: str = "guard"):
        if check in ("first", "always", "never"):
            raise ValueError(f"check {check!r} is gone: the guard now proves every step (no sampled self-check to "
                             "turn on or off); check='brute' adds a brute-force comparison on every step")
        for value, known, key in ((rule, RULES, "rule"), (sum_by, SUM_BY, "sum_by"), (form, FORMS, "form"),
                                  (check, CHECKS, "check")):
            if value not in known:
                raise ValueError(f"{key} {value!r} is unknown; known: {known}")
        if not 0 < C < float("inf"):
            raise ValueError(f"C must be a positive finite number, got {C!r}")
        if rule == "automatic" and not 0 < gamma < float("inf"):
            raise ValueError(f"gamma must be a positive finite number for the automatic rule, got {gamma!r}")
        self.model, self.C, self.rule, self.gamma = model, float(C), rule, float(gamma)
        self.sum_by, self.form, self.check = sum_by, form, check
        self.params = {id(p): (name, p) for name, p in model.named_parameters(remove_duplicate=True) if p.requires_grad}
        self._names = {m: name for name, m in model.named_modules(remove_duplicate=True)}  # for messages
        self._parent = {child: m for m in self._names for child in m.children()}
        self.layers, self._how, self._reads = self._layers()
        self._holders = {pid: [self._names[m] for m, ps in self.layers.items() if any(id(p) == pid for p in ps)]
                         for pid in self.params}
        self._hints = {id(p): self._subclass_hint(m) for m, how in self._how.items() if how == "capture"
                       for p in self.layers[m]}
        self._calls: list[_Call] = []
        self._flat: dict = {}  # this forward pass: recorded output edges of calls on flattened rows -> leading size
        self._active = False
        self._hint: int | None = None  # this forward pass's number of examples, from the batch
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
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
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
            fn = _ByAutograd(args, kwargs, which, self._reads[module])
            x = next((t for t in tensors if t.dim() and t.shape[0] == out.shape[0]), x)  # the batch-first input
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
        """Record one call; return the output the model goes on with (expanded over the batch where
        the call ran on a batch of one broadcast over the examples).

        The output is kept as its gradient edge (the autograd node that made it), not as a tensor: the
        gradient is asked for at that edge, so the output's memory (a language model's logits, B x T x V)
        is freed as in a plain step, and an in-place change of the output after the call (ReLU(inplace=True),
        out.mul_(10)) does not move the gradient read: it is the one at the layer's output as made. An
        output that is a view (nn.Linear and Conv1D on a (n, T, d) input return their 2-D product reshaped)
        is read at its base's edge: an in-place change of a view re-routes the gradient around the view's
        own node (autograd's CopySlices), to the base's. A partial view is held, with its version counter,
        and refused if changed in place. The input's version counter: an in-place change of the input after
        the call would make the values read other than the ones the layer used."""
        broadcast = False
        n = self._hint
        if (n is not None and n > 1 and output.dim() >= 2 and x.dim() == 1 and x.shape[0] != n
                and not x.is_floating_point() and not x.requires_grad):
            # one row of T indices with no batch dimension at all (positions, (T,) -> (T, d)): a batch of one
            output, x = output.unsqueeze(0), x.unsqueeze(0)
        if (n is not None and n > 1 and output.dim() and output.shape[0] == 1 and x.dim() and x.shape[0] == 1
                and not x.requires_grad):
            # a (1, T) row of constants (position ids) whose output is broadcast over the batch: expanded here,
            # every example reads its own copy, and the gradient at the expansion is per example (at the layer's
            # own output it is their sum). Broadcasting ops give the same values on the copies; a model that
            # reduced the (1, ...) output without broadcasting it against the batch would now reduce n copies.
            # An input with a gradient (a slice h[:1] of the batch) is not expanded, and refused after the pass.
            output, x, broadcast = output.expand(n, *output.shape[1:]), x.expand(n, *x.shape[1:]), True
        held, version = None, None
        base = output._base if output._is_view() and not broadcast else None
        if base is None:
            edge = get_gradient_edge(output)
        elif _plain_reshape(output, base, x):
            edge = get_gradient_edge(base)
        else:
            edge, held, version = output, output, output._version
        proof = _pair(edge if held is None else get_gradient_edge(output))
        lead = None
        if n is not None and x.dim() and x.shape[0] != n:
            lead = self._flattened_from(x)
            if lead is not None:
                self._flat[proof] = lead
        inputs = frozenset(_pair(get_gradient_edge(t)) for t in tensors if t.requires_grad)
        own = frozenset(id(p) for p in self.layers[module])
        self._calls.append(_Call(module, fn, x.detach(), edge, (output.shape, output.dtype),
                                 (x._version, held, version), lead,
                                 guard.Call(self._names.get(module) or "(the model)", proof, inputs, own),
                                 broadcast))
        return output

    def _flattened_from(self, x: torch.Tensor) -> int | None:
        """The leading size of the batch-first tensor whose rows ``x``'s rows are (OPT's feed-forward runs
        on ``h.reshape(-1, d)``): ``x`` a whole view of it, or made from it by a chain of one-input
        operations (a norm, an activation, a layer on flattened rows already found) from such a view."""
        if x._is_view():
            base = x._base
            if base.dim() > x.dim() and base.numel() == x.numel() and x.is_contiguous() and base.is_contiguous():
                return base.shape[0]
        node, nr = x.grad_fn, x.output_nr
        for _ in range(FLAT_DEPTH):
            if node is None:
                return None
            if (node, nr) in self._flat:
                return self._flat[(node, nr)]
            sizes = getattr(node, "_saved_self_sym_sizes", None)
            if sizes is not None and guard.operation(node) in ("view", "unsafeview", "reshapealias"):
                return int(sizes[0]) if len(sizes) > x.dim() else None
            nexts = [e for e in node.next_functions if e[0] is not None]
            if len(nexts) != 1:
                return None
            node, nr = nexts[0]
        return None

    # --- the two passes -----------------------------------------------------------------------

    def _uses(self, losses: torch.Tensor, keep_graph: bool) -> dict[int, list[Use]]:
        """Every recorded call's uses, by parameter id, from one gradient pass to the layers' outputs,
        once the guard has proved that no other use exists."""
        calls, self._calls, self._flat = self._calls, [], {}
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
        for call in calls:
            rows = call.meta[0][0] if len(call.meta[0]) else 0
            if rows == n or (call.lead == n and rows % n == 0):
                continue
            if rows == 1:
                raise Unsupported(f"a call of {call.proof.name} ran on a batch of 1 broadcast over the {n} examples, "
                                  "and its input was not of batch 1 too, so it could not be expanded per example: "
                                  "its output's gradient is the examples' sum; give the layer its input with one row "
                                  "per example")
            raise Unsupported(f"a call of {call.proof.name} returned shape {tuple(call.meta[0])}, whose first dimension "
                              f"is not the batch of {n} examples (nor rows flattened from it): its output is shared "
                              "by the whole batch (a bias table computed once, such as T5's relative-attention bias) "
                              "or laid out another way, so its gradient mixes the examples; compute it per example, "
                              "or freeze the layer's parameters (requires_grad=False)")
        self._adopt(calls)
        guard.prove(_pair(get_gradient_edge(losses)), [c.proof for c in calls], self.params, self._holders, self._hints)
        grads = torch.autograd.grad(losses.sum(), [c.edge for c in calls], retain_graph=keep_graph, allow_unused=True)
        uses: dict[int, list[Use]] = {}
        given: dict[nn.Module, set[int]] = {}
        for call, g in zip(calls, grads):
            shape, dtype = call.meta
            g = torch.zeros(shape, dtype=dtype, device=call.x.device) if g is None else g.reshape(shape)
            found = call.fn(call.module, _wide(call.x), _wide(g.detach()), n)
            given.setdefault(call.module, set()).update(id(p) for p, _ in found if p is not None)
            for p, use in found:
                if p is not None and id(p) in self.params:
                    uses.setdefault(id(p), []).append(use)
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
        uses = self._uses(losses, keep_graph=False)
        return losses.detach(), self._total(self._sq_norms(uses, losses.shape[0]), losses)

    def step(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any):
        """(losses, norms), and every trainable parameter's ``.grad`` set to the clipped sum
        sum_i c_i g_i (replacing what was there)."""
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
        for _, p in self.params.values():  # a parameter the batch did not reach: a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
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
            p.grad = sum(use.weighted_sum(c) for use in uses[pid]).reshape(p.shape).to(p.dtype)

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
        self._calls, self._flat, self._active, self._hint = [], {}, True, _batch_size(batch)
        torch.Tensor.register_hook = _refuse_gradient_hook
        try:
            losses = loss_fn(self.model, batch)
        finally:
            torch.Tensor.register_hook = _REGISTER_HOOK
            self._active = False
            while self._modes:  # a forward pass that raised inside a subclassed layer
                self._modes.pop()[1].__exit__(None, None, None)
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            self._calls = []
            raise ValueError(f"loss_fn must return the (n,) per-example losses, got "
                             f"{tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__}")
        if self._hint is not None and self._hint != losses.shape[0] and any(c.broadcast for c in self._calls):
            self._calls = []
            raise Unsupported(f"the batch's first tensor has {self._hint} rows and loss_fn returned {losses.shape[0]} "
                              "losses: a layer called on a batch of one was expanded over the wrong number of "
                              "examples; put a batch-first tensor of the examples first in the batch")
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
            hooks = module._forward_hooks
            if next(iter(hooks), None) != first:
                raise Unsupported(f"layer {self._names[module] or '(the model)'} has a forward hook "
                                  f"({_name_of(hooks[next(iter(hooks))])}) that runs before the engine records the "
                                  "call (registered with prepend=True after the engine was made): its change of the "
                                  "output would be read as the layer's own; register it without prepend=True")
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
        cpu, cuda, py, npy = rng
        after = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=list(cuda)):
            torch.set_rng_state(cpu)
            for d, state in cuda.items():
                torch.cuda.set_rng_state(state, d)
            random.setstate(py)
            np.random.set_state(npy)
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
