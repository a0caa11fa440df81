"""The shared clipping engine (``pipeline.clipping.PhantomClipping``) on every Hugging Face language
model family as shipped: each causal-LM, masked-LM and seq2seq-LM model type of the installed
transformers whose config has ``tie_word_embeddings``, built tiny with random weights (nothing is
downloaded), in float64, against one backward pass per example.

    python -m benchmarks.clipping_zoo                          # every family, 2 workers
    python -m benchmarks.clipping_zoo --only gpt2 t5 --json out.json
    python -m benchmarks.clipping_zoo --markdown --from-json docs/clipping_zoo.json
    python -m benchmarks.clipping_zoo --json docs/clipping_zoo.json --docs docs/clipping.md  # the committed run

Each family: its default config shrunk generically (``SIZES``: width 32, 2 layers, 2 heads, one
key-value head, vocabulary 96, 64 positions, 4 experts of which 2 per token; per-layer lists cut to
the layers, keeping each kind of layer the list has; special token ids moved into the vocabulary),
then ``OVERRIDES`` where a family needs more; ``tie_word_embeddings=True``, dropouts 0,
``model.eval()``. The batch: n = 4 examples of T = 8 tokens, the last one's last 3 tokens padded
(``attention_mask``), no position ids (the model's own defaults, as a user would call it); a
masked LM's targets are its inputs, a causal LM's the next tokens, a seq2seq LM's the decoder's next
tokens. The loss: each example's summed token cross-entropy over its non-padded targets. The
engine's ``per_example_norms`` and ``step`` (C = the median norm) against the brute force give the
outcome: ``exact`` (largest relative error of the norms and of the clipped sum below ``TOL``),
``refused`` (``Unsupported``: the engine says what it cannot account for), ``mismatch`` (above
``TOL``: a norm the engine got wrong, a privacy bug) or ``error`` (any other exception in the
engine). A family that cannot be built or run at that size has ``built: false`` and no outcome.
Each family runs in a worker process (a fresh one every ``--chunk`` families, and after a timeout or
a crash), ``--workers`` at a time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import subprocess
import time
import traceback
from collections import Counter, deque
from multiprocessing.connection import wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKERS = ("<!-- zoo:start -->", "<!-- zoo:end -->")  # docs/clipping.md's generated block lies between them
KINDS = {"causal": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),  # mapping, auto class
         "masked": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
         "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM")}
N, T, PADDED = 4, 8, 3  # examples, tokens, padded tokens at the end of the last example
TOL = 1e-8  # float64: the engine and the brute force sum the same terms in other orders
WIDTH, HEADS, HEAD_DIM = 32, 2, 16
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k")  # experts per token
SIZES = {  # an attribute of the default config (or of a sub-config) -> its tiny value, where it is an int
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "emb_dim", "embedding_size",
                     "word_embed_proj_dim", "input_embedding_size", "output_embedding_size", "embedding_dim",
                     "attention_hidden_size", "d_embed", "projection_dim", "mamba_d_ssm"), WIDTH),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers", "num_encoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_encoder_attention_heads", "num_decoder_attention_heads",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_num_heads", "index_n_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), 1),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "attention_head_size", "d_head", "attention_head_dim",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "index_head_dim",
                     "v_head_dim", "qk_head_dim"), HEAD_DIM),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim"), HEAD_DIM // 2),
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank"), 16),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner", "d_inner",
                     "feed_forward_size", "ffn_hidden_size"), 2 * WIDTH),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size"), WIDTH),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(TOP_K, 2),
    **dict.fromkeys(("n_group", "topk_group", "first_k_dense_replace", "num_dense_layers"), 1),
    "num_kv_shared_layers": 0,  # layers reading another layer's keys and values: none of 2
    **dict.fromkeys(("expand", "mamba_expand"), 1),  # state-space layers: heads x head size = expand x width
    **dict.fromkeys(("mamba_n_heads", "n_mamba_heads"), HEADS),
    **dict.fromkeys(("mamba_d_head", "mamba_headdim"), HEAD_DIM),
    **dict.fromkeys(("mamba_d_state", "state_size"), 16),
    **dict.fromkeys(("n_groups", "mamba_n_groups", "mamba_ngroups"), 1),
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank"), 8),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length"), 64),
    **dict.fromkeys(("vocab_size", "decoder_vocab_size"), 96),
}
UNSET_TOO = {"head_dim", "num_key_value_heads", "vocab_size", "intermediate_size", "n_routed_experts",
             "num_experts_per_tok"}  # set where the default is None too (ESM's vocabulary, DOTS1's experts)
OVERRIDES: dict[str, dict] = {  # model type -> config values a family needs beyond the generic path
    "diffllama": {"num_key_value_heads": 2},  # splits the values across key-value heads in pairs
    "esmc": {"num_key_value_heads": 2},  # no grouped-query attention
    "dory": {"layer_types": ["sliding_attention", "full_attention"], "n_input_layers": 1, "n_recurrent_layers": 0,
             "n_output_layers": 1},  # input + recurrent + output layers = the layers
    "dots1": {"n_shared_experts": 1},  # None by default, which it cannot build
    "esm": {"pad_token_id": 1},  # None by default, which its embeddings cannot mask
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # None by default, which it cannot build
    "reformer": {"axial_pos_embds_dim": [16, 16], "axial_pos_shape": [8, 8],  # their dims sum to the width
                 "attn_layers": ["local", "lsh"]},
    "xmod": {"default_language": "en_XX"},  # its adapters need a language
}


def families(only: list[str] | None = None) -> list[dict]:
    """Every (model type, kind) of the three auto mappings whose config has ``tie_word_embeddings``, with
    its class name; ``only`` keeps those model types."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    found = []
    for kind, (mapping, _) in KINDS.items():
        for model_type, class_name in getattr(modeling_auto, mapping).items():
            if only and model_type not in only:
                continue
            if model_type in CONFIG_MAPPING and _ties(model_type):
                found.append({"model_type": model_type, "kind": kind, "class": class_name})
    return found


def _ties(model_type: str) -> bool:
    """Whether the family's config has ``tie_word_embeddings`` (T5's sets it when made; a default
    config that cannot be made is asked through its class)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    try:
        return hasattr(AutoConfig.for_model(model_type), "tie_word_embeddings")
    except Exception:
        return hasattr(CONFIG_MAPPING[model_type], "tie_word_embeddings")


def _per_layer(values: list, layers: int) -> list:
    """A per-layer list cut to ``layers`` entries, in their order, keeping the first layer of each distinct
    kind first (a hybrid's attention and recurrent layers both stay), then the earliest others."""
    keys = [json.dumps(v, sort_keys=True) for v in values]
    firsts = [keys.index(k) for k in dict.fromkeys(keys)]
    others = [i for i in range(len(values)) if i not in firsts]
    return [values[i] for i in sorted((firsts + others)[:layers])]


def _shrunk(values: dict) -> dict:
    """A config's values (``to_dict()``) made tiny: ``SIZES``, per-layer lists, sub-configs, dropouts 0."""
    layers_before = next((values[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers",
                                              "decoder_layers") if isinstance(values.get(k), int)), None)
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and "model_type" in value:
            value = _shrunk(value)
        elif isinstance(value, bool):
            pass
        elif key in SIZES and (isinstance(value, int) or value is None and key in UNSET_TOO):
            capped = key in EXPERT_KEYS + TOP_K and value is not None  # a dense or top-1 family stays one
            value = min(value, SIZES[key]) if capped else SIZES[key]
        elif isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            value = 0.0
        elif isinstance(value, list) and layers_before and len(value) == layers_before > 1:
            value = _per_layer(value, 2)
        elif key == "per_layer_config" and isinstance(value, dict) and value:
            value = _per_layer_config(value, 2)
        out[key] = value
    if isinstance(out.get("kv_lora_rank"), int):  # multi-head latent attention: rotary on its own slice, no groups
        out.update(head_dim=out.get("qk_rope_head_dim", HEAD_DIM), num_key_value_heads=HEADS)
    return _token_ids(out)


def _per_layer_config(values: dict, layers: int) -> dict:
    """Per-layer settings keyed by layer index (``SIZES`` applied), for the first ``layers`` layers; where none
    of those has any, the first one that has is moved to the last layer (a global layer among local ones
    stays)."""
    sized = {k: {key: SIZES[key] if key in SIZES and _count(v) else v for key, v in each.items()}
             for k, each in values.items()}
    kept = {k: v for k, v in sized.items() if int(k) < layers}
    first = min(sized, key=int)
    return kept or {type(first)(layers - 1): sized[first]}


def _token_ids(values: dict) -> dict:
    """Special token ids past the tiny vocabulary moved to its top rows, one row per distinct id (an
    image token past the vocabulary would leave the model's lookup; two names of one id stay one)."""
    vocab = values.get("vocab_size")
    if not isinstance(vocab, int):
        return values
    moved: dict[int, int] = {}
    for key, value in values.items():
        if _is_token_id(key) and _count(value) and value >= vocab:
            values[key] = moved.setdefault(value, vocab - 1 - len(moved))
    return values


def _is_token_id(key: str) -> bool:
    return isinstance(key, str) and key.endswith(("token_id", "token_index", "_index"))


def _walk(config):
    """Every (key, value) of a config and of its sub-configs, nested dicts opened."""
    stack = [config.to_dict()]
    while stack:
        for key, value in stack.pop().items():
            if isinstance(value, dict):
                stack.append(value)
            else:
                yield key, value


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def special_ids(config) -> set[int]:
    """Every token id a config (or a sub-config) names: the batch draws its tokens from the others."""
    found = set()
    for key, value in _walk(config):
        if _is_token_id(key) and _count(value):
            found.add(value)
        elif isinstance(key, str) and key.endswith("token_id") and isinstance(value, list):
            found.update(v for v in value if _count(v))
    return found


def tiny_config(model_type: str, kind: str):
    """The family's default config shrunk (``SIZES``, then ``OVERRIDES``), tied (its sub-configs too),
    without dropout or cache; a causal LM of an encoder family (BERT's) as a decoder, as its class asks."""
    from transformers import AutoConfig

    values = _shrunk(AutoConfig.for_model(model_type).to_dict())
    values.update(OVERRIDES.get(model_type, {}))
    if kind == "causal" and "is_decoder" in values:
        values["is_decoder"] = True
    # experts by the eager loop: the default grouped_mm kernel has no float64 on the CPU
    values.update(tie_word_embeddings=True, use_cache=False, experts_implementation="eager")
    for sub in values.values():  # a composite's language model ties by its own config (Emu3's, Qwen3.5's)
        if isinstance(sub, dict) and "tie_word_embeddings" in sub:
            sub["tie_word_embeddings"] = True
    for key in ("model_type", "transformers_version", "architectures"):
        values.pop(key, None)
    return AutoConfig.for_model(model_type, **values)


def is_moe(config) -> bool:
    """Whether the config (or a sub-config) has more than one expert."""
    return any(key in EXPERT_KEYS and _count(value) and value > 1 for key, value in _walk(config))


def build(model_type: str, kind: str):
    """The tiny model, by the kind's auto class as a user would make it, random weights from seed 0, in
    float64 and eval mode."""
    import torch
    import transformers

    config = tiny_config(model_type, kind)
    torch.manual_seed(0)
    model = getattr(transformers, KINDS[kind][1]).from_config(config).to(torch.float64)
    return model.eval(), config


def make_batch(model, config, kind: str) -> dict:
    """n examples of T tokens, the last example's last ``PADDED`` padded, tokens drawn from the
    vocabulary less its special ids; the targets and which of them count."""
    import torch

    text = config.get_text_config()
    vocab = min(getattr(model.get_input_embeddings(), "num_embeddings", None) or text.vocab_size, text.vocab_size)
    allowed = torch.tensor(sorted(set(range(vocab)) - special_ids(config)))
    g = torch.Generator().manual_seed(0)
    ids = allowed[torch.randint(0, len(allowed), (N, T + 1), generator=g)]
    mask = torch.ones(N, T, dtype=torch.long)
    mask[-1, T - PADDED:] = 0
    pad = getattr(text, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    inputs = ids[:, :T].masked_fill(mask == 0, pad)
    batch = {"inputs": {"input_ids": inputs, "attention_mask": mask}}
    if kind == "causal":
        batch.update(targets=ids[:, 1:T], weights=mask[:, 1:].to(torch.float64))
    elif kind == "masked":
        batch.update(targets=inputs, weights=mask.to(torch.float64))
    else:
        decoder = allowed[torch.randint(0, len(allowed), (N, T + 1), generator=g)]
        batch["inputs"]["decoder_input_ids"] = decoder[:, :T]
        batch.update(targets=decoder[:, 1:], weights=torch.ones(N, T, dtype=torch.float64))
    return batch


def per_example_loss(model, batch: dict):
    """Each example's summed token cross-entropy over its non-padded targets, (n,) (a causal LM's last
    position predicts no target)."""
    import torch.nn.functional as F

    targets = batch["targets"]
    logits = model(**batch["inputs"]).logits[:, : targets.shape[1]]
    ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (ce * batch["weights"]).sum(1)


def brute_force(model, batch: dict):
    """Per-example gradients, one backward pass each: (losses, norms, {parameter: (n, *shape)})."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    losses = per_example_loss(model, batch)
    grads = {id(p): [] for p in params}
    for i in range(losses.shape[0]):
        found = torch.autograd.grad(losses[i], params, retain_graph=i + 1 < losses.shape[0], allow_unused=True)
        for p, g in zip(params, found):
            grads[id(p)].append(torch.zeros_like(p) if g is None else g)
    grads = {pid: torch.stack(gs) for pid, gs in grads.items()}
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    return losses.detach(), norms, grads


def _frame(tb, where: str | None = None) -> str | None:
    """The innermost frame of a traceback (within files whose path holds ``where``), as path:line in function."""
    frames = [f for f in traceback.extract_tb(tb) if where is None or where in f.filename.replace("\\", "/")]
    if not frames:
        return None
    f = frames[-1]
    path = f.filename.replace("\\", "/")
    if "site-packages/" in path:
        path = path.split("site-packages/")[-1]
    elif path.startswith(f"{ROOT}/"):
        path = path[len(str(ROOT)) + 1:]
    return f"{path}:{f.lineno} in {f.name}"


def _first_line(e: BaseException) -> str:
    """The message's first line, with the next one where the first only introduces it (a config's
    validation error: "Class validation error for validator 'validate_architecture':")."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()] or [""]
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def _norms_error(have, want) -> float:
    """The largest relative error of the per-example norms."""
    return float(((have - want).abs() / want.clamp(min=1e-300)).max())


def _sum_error(model, want: dict) -> float:
    """The relative error of the clipped sum in ``p.grad``, all parameters as one vector."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    have = torch.cat([p.grad.flatten() for p in params])
    truth = torch.cat([want[id(p)].flatten() for p in params])
    return float(torch.linalg.vector_norm(have - truth) / torch.linalg.vector_norm(truth).clamp(min=1e-300))


def run_family(model_type: str, kind: str) -> dict:
    """One family, in this process: build it, brute-force it, run the engine; the row (see the module)."""
    import torch
    from transformers.models.auto import modeling_auto

    from pipeline.clipping import PhantomClipping, Unsupported, coefficients

    row = {"model_type": model_type, "kind": kind, "class": getattr(modeling_auto, KINDS[kind][0])[model_type],
           "moe": None, "built": False}
    start = time.perf_counter()
    try:
        model, config = build(model_type, kind)
        row["class"], row["moe"] = type(model).__name__, is_moe(config)
        batch = make_batch(model, config, kind)
        losses, norms, grads = brute_force(model, batch)
        if not torch.isfinite(norms).all():
            raise FloatingPointError(f"the model's own per-example gradient norms are not finite: {norms.tolist()}")
        C = float(norms.median())
        c = coefficients(norms, C=C)
        want = {pid: torch.einsum("n,n...->...", c.to(g.dtype), g) for pid, g in grads.items()}
        row.update(built=True, parameters=sum(p.numel() for p in model.parameters()),  # a float32 one: say so
                   parameter_dtypes=sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()}))
    except Exception as e:  # the family does not build or run at this size: no outcome
        row.update(build_error=f"{type(e).__name__}: {_first_line(e)}", raised_at=_frame(e.__traceback__))
        return _timed(row, start)
    stage = "init"
    try:
        engine = PhantomClipping(model, C=C)
        row["ties"] = engine.ties()
        stage = "per_example_norms"
        row["norms_error"] = _norms_error(engine.per_example_norms(per_example_loss, batch)[1], norms)
        stage = "step"
        engine.step(per_example_loss, batch)
        row["sum_error"] = _sum_error(model, want)
    except Unsupported as e:
        row.update(outcome="refused", stage=stage, reason=str(e))
        return _timed(row, start)
    except Exception as e:
        row.update(outcome="error", stage=stage, reason=f"{type(e).__name__}: {_first_line(e)}",
                   where=_frame(e.__traceback__, "pipeline/clipping"), raised_at=_frame(e.__traceback__))
        return _timed(row, start)
    row["error"] = max(row["norms_error"], row["sum_error"])
    row["outcome"] = "exact" if row["error"] < TOL else "mismatch"
    return _timed(row, start)


def _timed(row: dict, start: float) -> dict:
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def _serve(conn) -> None:
    """A worker: runs the families it is sent, one at a time, until it is sent None."""
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    while (task := conn.recv()) is not None:
        conn.send(run_family(task["model_type"], task["kind"]))


class _Worker:
    """A worker process and the family it is running (None when idle), with its deadline."""

    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.task, self.deadline, self.done = None, 0.0, 0

    def send(self, task: dict, timeout: float) -> None:
        self.task, self.deadline = task, time.monotonic() + timeout
        self.conn.send(task)

    def stop(self, kill: bool) -> None:
        if kill:
            self.process.kill()
        else:
            self.conn.send(None)
        self.process.join()
        self.conn.close()


def run_all(tasks: list[dict], workers: int, timeout: float, chunk: int, report) -> list[dict]:
    """Every task in worker processes (spawned, ``workers`` at a time, each replaced after ``chunk``
    families, a timeout or a crash); ``report(row, done, total)`` after each."""
    ctx = multiprocessing.get_context("spawn")
    pending, rows, pool = deque(tasks), [], []
    while pending or any(w.task for w in pool):
        while pending and len([w for w in pool if w.task]) < workers:
            idle = next((w for w in pool if not w.task), None) or _Worker(ctx)
            pool = pool if idle in pool else pool + [idle]
            idle.send(pending.popleft(), timeout)
        busy = [w for w in pool if w.task]
        ready = wait([w.conn for w in busy], timeout=max(0.0, min(w.deadline for w in busy) - time.monotonic()))
        for w in busy:
            row = _collected(w, ready, timeout)
            if row is None:
                continue
            rows.append(row)
            report(row, len(rows), len(tasks))
            w.task, w.done = None, w.done + 1
            failed = row.get("stage") == "worker"  # a timeout or a crash: the process is killed, not asked
            if failed or w.done >= chunk:
                w.stop(kill=failed)
                pool.remove(w)
    for w in pool:
        w.stop(kill=False)
    return rows


def _collected(w: _Worker, ready: list, timeout: float) -> dict | None:
    """A busy worker's row if it has one, a timeout's or a crash's row, or None while it runs."""
    if w.conn in ready:
        try:
            return w.conn.recv()
        except EOFError:  # the process died (a segfault, killed for memory)
            w.process.join()
            return dict(w.task, moe=None, built=None, outcome="error", stage="worker",
                        reason=f"the worker process died (exit code {w.process.exitcode})")
    if time.monotonic() >= w.deadline:
        return dict(w.task, moe=None, built=None, outcome="error", stage="worker",
                    reason=f"timeout: no result within {timeout:g} s")
    return None


def summary(rows: list[dict]) -> dict:
    """Counts per outcome, dense and MoE apart (unbuilt families as ``not built``), and the share of
    buildable dense families that are exact."""
    counts = {"dense": Counter(), "moe": Counter()}
    for row in rows:
        counts["moe" if row.get("moe") else "dense"][row.get("outcome", "not built")] += 1
    dense_built = sum(n for k, n in counts["dense"].items() if k != "not built")
    return {"families": len(rows), "dense": dict(counts["dense"]), "moe": dict(counts["moe"]),
            "dense_exact_percent": round(100 * counts["dense"]["exact"] / dense_built, 1) if dense_built else None}


SHORT = (  # the engine's refusals (pipeline/clipping), their pattern -> a few words
    (r"layer (\S+) \((\S+)\) has no registered function", "unregistered {2} holds parameters ({1})"),
    (r"layer (\S+) \((\S+)\) mixes the examples", "batch-mixing {2} holds parameters ({1})"),
    (r"layer (\S+) has no registered function, and torch.func could not run its forward one example at a time "
     r"\((.{0,60})", "unregistered {1}: torch.func cannot run it per example ({2}...)"),
    (r"layer (\S+) has no registered function, and the gradients of its (\S+) computed one example",
     "unregistered {1}: its {2}'s per-example gradients do not add up to the batch's"),
    (r"parameter (\S+) is used by `([^`]*)` outside the calls", "{1} used by `{2}` outside its layers' calls"),
    (r"parameter (\S+) is reached from inside a call of (\S+), which does not hold it",
     "{1} used inside a call of {2}, which does not hold it"),
    (r"a call of (\S+) ran on a batch of 1", "{1} called on a batch of 1 broadcast over the examples"),
    (r"a call of (\S+) returned shape (\([^)]*\)), whose first dimension is not the batch",
     "{1} returns {2}, not batch-first (shared by the batch)"),
    (r"parameter (\S+): its per-example gradient norm is not", "self-check: {1} used outside its layers' calls"),
    (r"StrictDataclassClassValidationError: Class validation error for validator '\w+': \w+: (.*)",
     "its config is refused: {1}"),  # a build failure: the config's own validation
)


def short_reason(row: dict) -> str:
    """A refusal's, an error's or a build failure's reason in a few words (for the table)."""
    reason = row.get("reason") or row.get("build_error") or ""
    for pattern, words in SHORT:
        if m := re.match(pattern, reason):  # a class by its name alone, not its module's path
            return words.format(None, *(re.sub(r"^(transformers|torch)\.[\w.]*\.(?=\w+$)", "", g) for g in m.groups()))
    return reason if len(reason) <= 100 else reason[:97] + "..."


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _counts(counts: dict) -> str:
    order = ("exact", "refused", "error", "mismatch", "not built")
    return ", ".join(f"{counts.get(k, 0)} {k}" for k in order)


def markdown(saved: dict) -> str:
    """A saved run (``--json``) as docs/clipping.md shows it: one line of counts, then the table (family,
    kind, the ties the engine found, the outcome with the largest relative error or the reason shortened)."""
    s = saved["summary"]
    lines = [f"Run on {saved['date']} with transformers {saved['transformers']} and torch {saved['torch']}, the "
             f"engine at {saved['engine']} ({saved['minutes']} min on {saved['workers']} workers): {s['families']} "
             f"families. Dense: {_counts(s['dense'])} ({s['dense_exact_percent']}% of the buildable dense families "
             f"exact). Mixture-of-experts: {_counts(s['moe'])}.", "",
             "| family | kind | ties found | outcome |", "| --- | --- | --- | --- |"]
    for row in saved["rows"]:
        ties = ("; ".join(f"{p}: {', '.join(holders)}" for p, holders in row["ties"].items()) or "none"
                if "ties" in row else "-")  # none found, or the engine refused the model before looking
        outcome = row.get("outcome")
        shown = (f"{outcome} ({row['error']:.1e})" if outcome in ("exact", "mismatch")
                 else f"{outcome}: {short_reason(row)}" if outcome else f"not built: {short_reason(row)}")
        family = row["model_type"] + (" (MoE)" if row.get("moe") else "")
        lines.append(f"| {_cell(family)} | {row['kind']} | {_cell(ties)} | {_cell(shown)} |")
    return "\n".join(lines)


def _split(page: str) -> tuple[str, str, str]:
    """A page as (up to its first marker, between the markers, from its second marker)."""
    start, end = MARKERS
    head, rest = page.split(start, 1)
    block, tail = rest.split(end, 1)
    return head + start, block.strip("\n"), end + tail


def docs_block(page: str) -> str:
    """The text of a page between its ``MARKERS``."""
    return _split(page)[1]


def write_docs(path: Path, saved: dict) -> None:
    """The page's text between its ``MARKERS`` replaced by the run's ``markdown``."""
    head, _, tail = _split(path.read_text())
    path.write_text(f"{head}\n{markdown(saved)}\n{tail}")


def _engine_commit() -> str:
    """The last commit that changed the engine (pipeline/clipping), with ``+changes`` where the files differ
    from it."""
    head = subprocess.run(["git", "log", "-1", "--format=%h", "--", "pipeline/clipping"], cwd=ROOT,
                          capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "pipeline/clipping"], cwd=ROOT, capture_output=True,
                           text=True)
    return (head.stdout.strip() or "unknown") + ("+changes" if dirty.stdout.strip() else "")


def _progress(row: dict, done: int, total: int) -> None:
    outcome = row.get("outcome") or "not built"
    detail = f"{row['error']:.1e}" if "error" in row else short_reason(row)
    print(f"[{done:>3}/{total}] {row['kind']:<7} {row['model_type']:<28} {outcome:<9} {detail}"
          f"{'  (MoE)' if row.get('moe') else ''}  {row.get('seconds', '-')} s", flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="these model types only")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per family")
    parser.add_argument("--chunk", type=int, default=8, help="families per worker process before a fresh one")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--markdown", action="store_true", help="print the table (of --from-json's run if given)")
    parser.add_argument("--from-json", type=Path, help="a run saved by --json, instead of running")
    parser.add_argument("--docs", type=Path, help=f"write the table into this page, between {' and '.join(MARKERS)}")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
    else:
        import torch
        import transformers

        start, engine = time.monotonic(), _engine_commit()
        rows = run_all(families(args.only), args.workers, args.timeout, args.chunk, _progress)
        rows.sort(key=lambda r: (r["model_type"], r["kind"]))
        if _engine_commit() != engine:  # workers start afresh every --chunk families: they may have run both
            engine = f"{engine} to {_engine_commit()}"
        saved = {"date": time.strftime("%Y-%m-%d"), "transformers": transformers.__version__,
                 "torch": torch.__version__, "engine": engine, "workers": args.workers,
                 "minutes": round((time.monotonic() - start) / 60, 1), "summary": summary(rows), "rows": rows}
        if args.json:
            args.json.write_text(json.dumps(saved, indent=1) + "\n")
    if args.markdown:
        print(markdown(saved))
    if args.docs:
        write_docs(args.docs, saved)
    s = saved["summary"]
    print(f"{s['families']} families. Dense: {_counts(s['dense'])} ({s['dense_exact_percent']}% of the buildable "
          f"dense families exact). Mixture-of-experts: {_counts(s['moe'])}.")
    return saved["rows"]


if __name__ == "__main__":
    main()
