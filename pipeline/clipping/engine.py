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

What it cannot see it refuses (``Unsupported``), never computing a smaller norm: a trainable
parameter held by a layer type without a registered function (``register`` one; a bare
``nn.Parameter`` of a custom module is such a case), a layer called on a batch of one broadcast over
the examples (its output's gradient is their sum: Hugging Face's default (1, T) position ids), or a
parameter that is also used outside its layers' calls (``F.linear(x, self.wte.weight)``). The last is caught by the self-check (``check="first"``,
the default: on the first step; ``"always"``; ``"never"``): each parameter's per-example norms of
the first three examples must equal those of one backward pass per example (on a forward pass
of its own, from the step's random states: the same dropout masks, after the step's graph is
freed). A layer's output gradient is read at the layer's autograd edge (its base's, for an output
that is a whole view of a product), not at its output tensor: the engine holds no output (a language
model's logits) through the gradient pass, and an in-place change of an output after its layer
(``ReLU(inplace=True)``) is exact; of a partial view, refused.
Batch-mixing layers (BatchNorm) have no per-example gradient and are refused.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from pipeline.clipping.layers import lookup
from pipeline.clipping.uses import Use, inner, merged

RULES = ("classic", "automatic")
CHECKS = ("first", "always", "never")
SUM_BY = ("bookkeeping", "backward")
FORMS = ("auto", "gram", "direct")
MIXING = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)  # GroupNorm is per-example, but unregistered: named
CHECK_RTOL = 1e-3  # the self-check's tolerance on squared norms (float32 sums taken in two orders)
# ... and its floor, CHECK_FLOOR eps^2 of the example's whole squared norm (eps of the parameters' dtype: 1.4e-13
# in float32): a parameter whose true gradient is zero (a key projection's bias, by the softmax's shift
# invariance) carries rounding residues (measured: up to 5e-19 of the whole in float32) that no relative
# tolerance matches. Rounding's level, far below any parameter that learns (the smallest on DPFormer's
# first step: 1e-11 of the whole, a key projection at init)
CHECK_FLOOR = 10
CHECK_EXAMPLES = 3  # examples of the first batch checked against one backward pass each


class Unsupported(TypeError):
    """The model holds something the engine cannot account for exactly."""


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
    """The (P, Q) a per-example gradient of ``p`` is handled as: a matrix as it is, a vector as (1, Q)."""
    if p.dim() == 1:
        return 1, p.numel()
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


class PhantomClipping:
    """Per-example gradient norms and their clipped sum for ``model`` (see the module's docstring)."""

    def __init__(self, model: nn.Module, C: float, *, rule: str = "classic", gamma: float = 0.01,
                 sum_by: str = "bookkeeping", form: str = "auto", check: str = "first"):
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
        self.layers = self._layers()
        self._names = {m: name for name, m in model.named_modules(remove_duplicate=True)}  # for messages
        self._calls: list[tuple] = []  # (layer, input, output's gradient edge, its (shape, dtype), input's version)
        self._active = False
        self._checked = False
        for module in self.layers:
            module.register_forward_hook(self._record, with_kwargs=True)

    def ties(self) -> dict[str, list[str]]:
        """Each trainable parameter held by more than one layer, with those layers' names (found by
        identity: ``{'transformer.wte.weight': ['transformer.wte', 'lm_head']}`` for GPT-2)."""
        names = self._names
        found = {}
        for pid, (name, _) in self.params.items():
            holders = [names[m] for m, ps in self.layers.items() if any(id(p) == pid for p in ps)]
            if len(holders) > 1:
                found[name] = holders
        return found

    def _layers(self) -> dict[nn.Module, list[nn.Parameter]]:
        """The layers holding the trainable parameters, each of a registered type; Unsupported otherwise."""
        found: dict[nn.Module, list[nn.Parameter]] = {}
        for name, module in self.model.named_modules(remove_duplicate=True):
            own = [(k, p) for k, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            if isinstance(module, MIXING) or lookup(module) is None:
                kind = f"{type(module).__module__}.{type(module).__qualname__}"
                why = "mixes the examples of a batch" if isinstance(module, MIXING) else "has no registered function"
                held = [f"{name}.{k}" if name else k for k, _ in own]
                raise Unsupported(f"layer {name or '(the model)'} ({kind}) {why}, and holds the trainable {held}: "
                                  "their per-example gradients cannot be accounted for; register a function for "
                                  "the layer (pipeline.clipping.register), move them into a known layer, or freeze "
                                  "them (requires_grad=False)")
            if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
                raise Unsupported(f"layer {name} (nn.Embedding) has scale_grad_by_freq=True: each example's gradient "
                                  "is scaled by the counts of the whole batch, so it is no per-example gradient")
            found[module] = [p for _, p in own]
        return found

    def _record(self, module, args, kwargs, output):
        if not (self._active and torch.is_grad_enabled()):
            return
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        x = args[0] if args else next(iter(kwargs.values()))
        # The output is kept as its gradient edge (the autograd node that made it), not as a tensor: the
        # gradient is asked for at that edge, so the output's memory (a language model's logits, B x T x V)
        # is freed as in a plain step, and an in-place change of the output after the call (ReLU(inplace=True),
        # out.mul_(10)) does not move the gradient read: it is the one at the layer's output as made. An
        # output that is a view (nn.Linear and Conv1D on a (n, T, d) input return their 2-D product reshaped)
        # is read at its base's edge: an in-place change of a view re-routes the gradient around the view's
        # own node (autograd's CopySlices), to the base's. A partial view is held, with its version counter,
        # and refused if changed in place. The input's version counter: an in-place change of the input after
        # the call would make the values read other than the ones the layer used.
        held, version = None, None
        base = output._base if output._is_view() else None
        if base is None:
            edge = get_gradient_edge(output)
        elif _plain_reshape(output, base, x):
            edge = get_gradient_edge(base)
        else:
            edge, held, version = output, output, output._version
        self._calls.append((module, x.detach(), edge, (output.shape, output.dtype), (x._version, held, version)))

    # --- the two passes -----------------------------------------------------------------------

    def _uses(self, losses: torch.Tensor, keep_graph: bool) -> dict[int, list[Use]]:
        """Every recorded call's uses, by parameter id, from one gradient pass to the layers' outputs."""
        calls, self._calls = self._calls, []
        if not calls:
            raise Unsupported("the loss depends on no layer of the model that holds a trainable parameter")
        names = self._names
        for module, x, _, _, (version, held, held_version) in calls:
            if x._version != version or (held is not None and held._version != held_version):
                which = "input" if x._version != version else "output (a partial view)"
                raise Unsupported(f"the {which} of {names.get(module, type(module).__name__)} was changed in "
                                  "place after the call (x.mul_(...)): the engine would read other values than the "
                                  "layer used; make that operation out of place")
        grads = torch.autograd.grad(losses.sum(), [edge for _, _, edge, _, _ in calls], retain_graph=keep_graph,
                                    allow_unused=True)
        n = losses.shape[0]
        uses: dict[int, list[Use]] = {}
        for (module, x, _, (shape, dtype), _), g in zip(calls, grads):
            g = torch.zeros(shape, dtype=dtype, device=x.device) if g is None else g.reshape(shape)
            if shape[0] != n:  # a batch of 1 broadcast over the examples: its gradient is their sum
                raise Unsupported(f"a call of {names.get(module, type(module).__name__)} has batch size "
                                  f"{shape[0]}, the losses {n}: its output's gradient mixes the examples; give "
                                  "every layer its inputs batch first, one row per example (Hugging Face models: "
                                  "pass position_ids of shape (n, T), not the (1, T) they default to)")
            given = lookup(module)(module, _wide(x), _wide(g.detach()), n)
            missing = {id(p) for p in self.layers[module]} - {id(p) for p, _ in given if p is not None}
            if missing:  # a layer function that leaves out a parameter would count it as zero
                left = [self.params[pid][0] for pid in missing if pid in self.params]
                raise Unsupported(f"the function registered for {names.get(module, type(module).__name__)} gives no "
                                  f"per-example gradient for its trainable {left} (a parametrisation such as "
                                  "weight_norm?): register one that gives every parameter the layer holds")
            for p, use in given:
                if p is not None and id(p) in self.params:
                    uses.setdefault(id(p), []).append(use)
        return {pid: merged(found) for pid, found in uses.items()}

    def _sq_norms(self, uses: dict[int, list[Use]], n: int) -> dict[int, torch.Tensor]:
        """Each parameter's per-example squared gradient norms, (n,), by parameter id."""
        per: dict[int, torch.Tensor] = {}
        for pid, found in uses.items():
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
        total = torch.zeros(losses.shape[0], device=losses.device,
                            dtype=torch.float64 if losses.dtype == torch.float64 else torch.float32)
        for sq in per.values():
            total = total + sq.to(total.dtype)
        return total.clamp(min=0).sqrt()

    def per_example_norms(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any):
        """(losses, norms): each (n,), the norms of the whole model's per-example gradients; no
        parameter gradient is formed or changed."""
        losses = self._forward(loss_fn, batch)
        uses = self._uses(losses, keep_graph=False)
        return losses.detach(), self._total(self._sq_norms(uses, losses.shape[0]), losses)

    def step(self, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any):
        """(losses, norms), and every trainable parameter's ``.grad`` set to the clipped sum
        sum_i c_i g_i (replacing what was there)."""
        checking = self.check == "always" or (self.check == "first" and not self._checked)
        rng = self._rng_states() if checking else None  # the self-check's forward pass draws the same dropout
        losses = self._forward(loss_fn, batch)
        uses = self._uses(losses, keep_graph=self.sum_by == "backward")
        n = losses.shape[0]
        per = self._sq_norms(uses, n)
        norms = self._total(per, losses)
        c = coefficients(norms, C=self.C, rule=self.rule, gamma=self.gamma).detach()
        for _, p in self.params.values():
            p.grad = None
        if self.sum_by == "bookkeeping":
            self._bookkeeping(uses, c)
        # The output gradients (the logits', B x T x V, among them) are not held through the second backward
        # pass or the self-check: a step's peak memory stays about that of a plain step's backward.
        del uses
        if self.sum_by == "backward":
            (c.to(losses.dtype) * losses).sum().backward()
        if checking:
            try:
                self._self_check(loss_fn, batch, per, rng)
            except BaseException:
                for _, p in self.params.values():  # no unchecked sum is left behind (a refusal, an error, Ctrl-C)
                    p.grad = None
                raise
            self._checked = True
        for _, p in self.params.values():  # a parameter the batch did not reach: a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return losses.detach(), norms

    def _bookkeeping(self, uses: dict[int, list[Use]], c: torch.Tensor) -> None:
        """``p.grad = sum_i c_i G_i`` from the recorded factors (a function of its own: no loop variable
        keeps a use, and with it an output gradient, alive after it)."""
        for pid, found in uses.items():
            p = self.params[pid][1]
            p.grad = sum(use.weighted_sum(c) for use in found).reshape(p.shape).to(p.dtype)

    def add_noise(self, multiplier: float, generator: torch.Generator | None = None) -> None:
        """The Gaussian mechanism on the clipped sum: N(0, (multiplier C)^2) added to every ``p.grad``.
        Each example's clipped gradient has norm at most C (both rules), so adding or removing one
        example moves the sum by at most C: the sensitivity the multiplier is calibrated for
        (``pipeline.privacy.dpsgd_noise_multiplier`` under Poisson sampling)."""
        if not 0 <= multiplier < float("inf"):
            raise ValueError(f"the noise multiplier must be a finite number >= 0, got {multiplier!r}")
        for _, p in self.params.values():
            if p.grad is None:
                raise RuntimeError("add_noise needs the clipped sum: call step first")
            noise = torch.randn(p.grad.shape, generator=generator, dtype=p.grad.dtype, device=p.grad.device)
            p.grad.add_(noise, alpha=multiplier * self.C)

    def _forward(self, loss_fn, batch) -> torch.Tensor:
        now = {id(p) for p in self.model.parameters() if p.requires_grad}
        if now != set(self.params):  # unfrozen, frozen, resized or re-tied since the engine was made
            raise Unsupported("the model's trainable parameters changed since the engine was made (a layer "
                              "unfrozen or frozen, an embedding resized or re-tied): make a new PhantomClipping")
        self._calls, self._active = [], True
        try:
            losses = loss_fn(self.model, batch)
        finally:
            self._active = False
        if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
            self._calls = []
            raise ValueError(f"loss_fn must return the (n,) per-example losses, got "
                             f"{tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__}")
        return losses

    def _rng_states(self) -> tuple:
        """The random states a forward pass draws from (the CPU's and each CUDA device's of the
        model, Python's and NumPy's global ones): the self-check's own forward pass is run from them, so its
        dropout masks are the step's, and they are put back after it (a checked step leaves the streams as an
        unchecked one). A model that draws from a generator of its own, or whose forward changes its state,
        gives the check another forward pass than the step's: use check="never" for it, after checking it
        on a copy."""
        devices = sorted({p.device.index or 0 for _, p in self.params.values() if p.device.type == "cuda"})
        return (torch.get_rng_state(), {d: torch.cuda.get_rng_state(d) for d in devices}, random.getstate(),
                np.random.get_state())

    def _self_check(self, loss_fn, batch, per: dict[int, torch.Tensor], rng: tuple) -> None:
        """Each parameter's per-example norms against a brute force, one backward pass per example,
        on the first ``CHECK_EXAMPLES`` examples: a use the engine did not record (a parameter used
        outside its layers' calls) or a wrong layer function shows as a difference. The brute force
        runs on a forward pass of its own (no hook records it), from the step's random states, after
        the step's graph is freed: the check adds time to the first step, not memory."""
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
        k = min(CHECK_EXAMPLES, losses.shape[0])
        for i in range(k):
            truth = torch.autograd.grad(losses[i], params, retain_graph=i + 1 < k, allow_unused=True)
            wants = [0.0 if want is None else float(want.double().pow(2).sum()) for want in truth]
            floor = CHECK_FLOOR * torch.finfo(params[0].dtype).eps ** 2 * sum(wants)
            for name, p, want_sq in zip(names, params, wants):
                have_sq = float(per[id(p)][i]) if id(p) in per else 0.0
                scale = max(want_sq, have_sq, 1e-30)
                if abs(have_sq - want_sq) > max(CHECK_RTOL * scale, floor):
                    raise Unsupported(
                        f"parameter {name}: its per-example gradient norm is not what the engine computed from "
                        f"the uses it recorded (example {i}: squared norm {have_sq:.6g}, one backward pass gives "
                        f"{want_sq:.6g}): it is used outside its layers' calls (F.linear(x, weight), h @ E.T, ...), "
                        "where no hook sees it; use it through its layer, or register the layer that uses it")
