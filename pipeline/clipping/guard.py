"""The guard: a proof, on every step, that the engine has seen every use of every trainable
parameter, made from the autograd graph of the step itself, with no tolerance and no sampling.

The engine computes a parameter's per-example gradient from the calls of the layers that hold it
(each call's input and its output's gradient, through the layer's registered function). That is the
whole per-example gradient exactly when every path of the graph from the losses to the parameter's
gradient accumulator enters through one of those calls' outputs and then stays inside that call
until it reaches the parameter. The guard walks the graph from the losses once and checks both:

* outside the recorded calls, the walk never reaches the accumulator of a trainable parameter
  (``F.linear(h, E)``, ``h @ W.T``, ``loss + 1e-6 * W.pow(2).sum()``, an in-place ``h.add_(E[0])``, a
  use on some examples or some steps only: each is such a path, whatever its weight in the loss);
* a recorded call's output leads, inside the call (until the walk meets one of the call's own tensor
  inputs, where it continues where the call was entered, or the output of a call nested in it, walked
  the same way), only to the accumulators of parameters its layer holds.

It runs between the forward pass and the gradient pass of every step (``step`` and
``per_example_norms``), before any ``p.grad`` is written, and costs one visit of each graph node
(``python -m benchmarks.clipping`` prints its share of a step). What it trusts: each registered layer
function is right for its layer type (``check="brute"`` tests that against one backward pass per
example). Hooks are the engine's to refuse (``PhantomClipping._refuse_unseen``): a gradient hook registered
during the forward pass, a layer's forward hook ahead of the engine's, global and backward module hooks.
Two operations are refused wherever they are met (``_hidden``): a batch normalisation on the batch's
statistics, and reentrant checkpointing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Operations that only move, reshape, cast or transpose a tensor: an error names the operation that
# used the parameter, looking through these to the one that computed with it (``mm`` through ``t``).
MOVES = {"t", "view", "unsafeview", "reshapealias", "expand", "permute", "transpose", "tocopy", "slice", "select",
         "unsqueeze", "squeeze", "clone", "alias", "asstrided", "unbind", "split", "splitwithsizes", "index"}


class Unsupported(TypeError):
    """The model holds or does something the engine cannot account for exactly."""


@dataclass
class Call:
    """One recorded call of a layer, as the guard sees it: the autograd edge of its output (where the
    engine reads the output's gradient), the edges of its tensor inputs (where a path leaves the call),
    and the ids of the parameters its layer function accounts for."""
    name: str
    out: tuple
    inputs: frozenset = field(default_factory=frozenset)
    own: frozenset = field(default_factory=frozenset)


def operation(node) -> str:
    """An autograd node's forward operation: ``MmBackward0`` -> ``mm``."""
    return re.sub(r"backward\d*$", "", type(node).__name__.lower()) if node is not None else "?"


def _used_by(node, parent: dict) -> str:
    """The operation that used a parameter, looking through moves: ``mm (through t)``."""
    ops = []
    while node is not None and len(ops) < 6:
        ops.append(operation(node))
        if ops[-1] not in MOVES:
            break
        node = parent.get(node)
    return ops[-1] if len(ops) == 1 else f"{ops[-1]} (through {', '.join(ops[:-1])})"


def prove(root: tuple, calls: list[Call], params: dict, holders: dict, hints: dict | None = None) -> None:
    """Walk the graph from ``root`` (the losses' autograd edge); raise ``Unsupported`` at the first
    path to a trainable parameter that no recorded call accounts for.
    ``params``: id -> (name, parameter) of the trainable parameters; ``holders``: id -> the names of
    the layers holding it, ``hints``: id -> what else a refusal of it should say (for messages)."""
    at: dict[tuple, list[int]] = {}
    for k, call in enumerate(calls):
        at.setdefault(call.out, []).append(k)
    stack: list[tuple] = [(root, None, None)]  # (edge, the call it is inside of or None, the node that led here)
    seen: set = set()
    entered: set[tuple] = set()
    parent: dict = {}  # outside the calls: each node's first predecessor, for messages
    while stack:
        edge, inside, up = stack.pop()
        node = edge[0]
        if inside is not None and edge in calls[inside].inputs:
            continue  # the path leaves the call by its input: walked from there where the call was entered
        # A recorded call's output (outside, or nested in the call the walk is inside of). Calls that share
        # an output (a module returning its child's output as it is) nest in the order they were recorded,
        # inner first: the walk enters the outermost not yet entered, and from inside it the next.
        hit = [k for k in at.get(edge, ()) if inside is None or calls[inside].out != edge or k < inside]
        if hit:
            k = hit[-1]
            if (k, inside) not in entered:
                entered.add((k, inside))
                stack.extend((e, inside, node) for e in calls[k].inputs)
                stack.append((edge, k, node))
            continue
        key = (node, inside)
        if key in seen:
            continue
        seen.add(key)
        if inside is None:
            parent.setdefault(node, up)
        unseen = _hidden(node)
        if unseen:
            raise Unsupported(unseen)
        variable = getattr(node, "variable", None)  # a gradient accumulator: a leaf tensor
        if variable is not None:
            pid = id(variable)
            if pid in params and (inside is None or pid not in calls[inside].own):
                raise _refusal(params[pid][0], holders.get(pid, []), up, parent,
                               None if inside is None else calls[inside].name, (hints or {}).get(pid, ""))
            continue
        stack.extend((e, inside, node) for e in node.next_functions if e[0] is not None)


def _hidden(node) -> str | None:
    """What a node does that no recorded call can account for, whatever the path: a batch normalisation on
    the batch's statistics (``F.batch_norm(..., training=True)``: each example's value depends on every
    other example's), and reentrant activation checkpointing (``checkpoint(..., use_reentrant=True)``),
    whose forward runs without a graph, so that the layers inside it are neither recorded nor walked."""
    op = operation(node)
    if "batchnorm" in op and "notraining" not in op and getattr(node, "_saved_training", True):
        return (f"a batch normalisation in training mode (`{op}`, batch statistics) is on a path from the losses: "
                "each example's value depends on every other example of the batch, so no per-example gradient "
                "bounds one example's effect; normalise per example (layer_norm, group_norm) or use running "
                "statistics (training=False)")
    if op == "checkpointfunction":
        return ("reentrant activation checkpointing (torch.utils.checkpoint with use_reentrant=True) runs its forward "
                "without a graph: the layers inside it are neither recorded nor seen by the guard; use "
                "use_reentrant=False (Hugging Face: gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False}))")
    return None


def _refusal(name: str, holders: list[str], up, parent: dict, inside: str | None, hint: str = "") -> Exception:
    held = f"the layers holding it: {', '.join(holders)}" if holders else "no layer of the model holds it"
    if inside is not None:
        return Unsupported(
            f"parameter {name} is reached from inside a call of {inside}, which does not hold it ({held}): "
            f"the layer's forward uses it through `{operation(up)}` on a tensor that is not one of the call's "
            "inputs, and the function registered for the layer cannot account for that; pass that tensor to the "
            "layer as an input, or register a function for a layer that holds the parameter")
    if hint:
        return Unsupported(f"parameter {name} is used by `{_used_by(up, parent)}` where no call recorded it ({held}): "
                           f"{hint}")
    return Unsupported(
        f"parameter {name} is used by `{_used_by(up, parent)}` outside the calls of the layers that hold it ({held}): "
        "no layer function accounts for that use, so the per-example norms would be too small and the privacy "
        "guarantee false; use the parameter through its layer (call lm_head(h), not F.linear(h, weight) or "
        "h @ weight.T), register the module that uses it (pipeline.clipping.register), or freeze it "
        "(requires_grad=False)")
