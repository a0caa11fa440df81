"""Time and peak memory of one DP-SGD step with each clipping engine, on a GPT-2-shaped model with a
tied embedding, against the non-private step of the same model in the same process.

    python -m benchmarks.clipping                              # V = 8k, 32k, 128k x B = 8, 32 on the CPU
    python -m benchmarks.clipping --V 32000 --B 16 --json out.json
    python -m benchmarks.clipping --device cuda                # the same on a GPU

The model: token and position embeddings, ``--layers`` pre-LayerNorm blocks (causal attention with
its query/key/value and output projections, a 4d MLP), a final LayerNorm and an output layer tied to
the token embedding (GPT-2's shape, built from nn modules so that every engine supports it).
Engines: ``non-private`` (one backward of the summed loss), ``phantom`` and ``phantom-backward``
(``pipeline.clipping``, the clipped sum by book-keeping or by a second backward pass), ``opacus-hooks``
(Opacus's per-example gradients, the tie kept: B x V x d floats for the table alone) and
``opacus-ghost`` (Opacus's ghost clipping on the untied model: it refuses the tie); on request,
``non-private-chunked`` and ``phantom-chunked``: the same model with its output layer and loss the
chunked tied head (``pipeline.clipping.chunked``: ``--chunk`` vocabulary rows at a time, no B x T x V
tensor), their ratios also to the chunked non-private step (``chunked_*_ratio``). Each is timed
over ``--repeats`` steps after one warm-up step (median); peak memory is the GPU's peak allocated
memory on CUDA, and on the CPU the step's growth of the resident set over the process's size before
it (``ru_maxrss``: cells are run in a fresh process each, so one engine's peak does not hide the
next's); on the CPU also the step's peak of live tensors (``tensor_peak``, from the profiler's
allocation records: unmoved by other work on the machine, which the resident set is not). Printed:
a table with each engine's ratios to non-private; ``--json``: every row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from benchmarks.measure import measure

ROOT = Path(__file__).resolve().parents[1]
warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus's hooks on id-fed layers
ENGINES = ("non-private", "phantom", "phantom-backward", "opacus-hooks", "opacus-ghost")
CHUNKED = ("non-private-chunked", "phantom-chunked")  # issue 76: the chunked tied head, on request


def build(V: int, d: int, layers: int, T: int, tied: bool, chunk: int | None = None):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, h):
            q, k, v = self.qkv(self.ln1(h)).chunk(3, -1)
            mask = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool, device=h.device).tril()
            att = (q @ k.transpose(1, 2) / d ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1)
            h = h + self.proj(att @ v)
            return h + self.out(torch.nn.functional.gelu(self.fc(self.ln2(h))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            if chunk is not None:  # the chunked tied head: forward(ids, targets) gives the per-token losses
                from pipeline.clipping.chunked import ChunkedTiedHead

                self.chunked = ChunkedTiedHead(self.wte, chunk)
            else:
                self.head = nn.Linear(d, V, bias=False)
                if tied:
                    self.head.weight = self.wte.weight

        def forward(self, ids, targets=None):
            n, t = ids.shape
            positions = torch.arange(t, device=ids.device).expand(n, t).contiguous()  # Opacus's ghost views them
            h = self.wte(ids.contiguous()) + self.wpe(positions)
            for block in self.blocks:
                h = block(h)
            if chunk is not None:
                return self.chunked(self.ln_f(h), targets)
            return self.head(self.ln_f(h))

    return GPT()


def tensor_peak(step, model) -> float:
    """GiB: one step's peak of live tensor memory above its start, every gradient set to None first (so
    each engine's step starts from the weights alone), from torch.profiler's allocation records in order
    (each operator's own allocations net of its own frees, and frees outside any operator). Unlike the
    resident set, it is the same beside other work: the CPU allocator's caching and other processes do
    not enter it (an operator's transient peak inside itself does not either)."""
    from torch.profiler import ProfilerActivity, profile

    for p in model.parameters():
        p.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    level = top = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        level += event.self_cpu_memory_usage
        top = max(top, level)
    return top / 2**30


def cell(engine: str, V: int, B: int, d: int, layers: int, T: int, repeats: int, device: str,
         chunk: int = 8192) -> dict:
    """One engine at one (V, B), in this process: median seconds per step and peak memory (GiB)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    dev = torch.device(device)
    chunked = engine.endswith("-chunked")
    engine = engine.removesuffix("-chunked")
    model = build(V, d, layers, T, tied=engine != "opacus-ghost", chunk=chunk if chunked else None).to(dev)
    ids = torch.randint(0, V, (B, T + 1), device=dev)

    def per_example(m, batch):
        if chunked:
            return m(batch[:, :-1], batch[:, 1:]).sum(1)
        logits = m(batch[:, :-1])
        return F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").sum(1)

    if engine == "non-private":
        def step():
            model.zero_grad(set_to_none=True)
            per_example(model, ids).sum().backward()
    elif engine.startswith("phantom"):
        from pipeline.clipping import PhantomClipping, guard

        clip = PhantomClipping(model, C=1.0, sum_by="backward" if engine == "phantom-backward" else "bookkeeping")
        proven = guard.prove

        def timed(*args):  # the guard's own time in each step (the engine calls guard.prove)
            start = time.perf_counter()
            proven(*args)
            proofs.append(time.perf_counter() - start)

        guard.prove = timed

        def step():
            clip.step(per_example, ids)
    else:
        from opacus import GradSampleModule
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        if engine == "opacus-hooks":
            wrapped = GradSampleModule(model)

            def step():
                wrapped.zero_grad(set_to_none=True)
                for p in wrapped.parameters():
                    p.grad_sample = None
                per_example(wrapped, ids).sum().backward()
                norms = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in wrapped.parameters()
                                     if p.grad_sample is not None]).norm(dim=0)
                c = (1.0 / (norms + 1e-6)).clamp(max=1.0)
                for p in wrapped.parameters():
                    if p.grad_sample is not None:
                        p.grad = torch.einsum("n,n...->...", c, p.grad_sample)
        else:
            wrapped = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="sum",
                                                           max_grad_norm=1.0, use_ghost_clipping=True)

            def step():  # as pipeline/clipping/opacus.py's Ghost: norms by hooks, then the re-weighted backward
                wrapped.zero_grad(set_to_none=True)
                losses = per_example(wrapped, ids)
                losses.sum().backward(retain_graph=True)
                c = (1.0 / (wrapped.get_norm_sample().detach() + 1e-6)).clamp(max=1.0)
                wrapped.zero_grad(set_to_none=True)
                wrapped.disable_hooks()
                try:
                    (c * losses).sum().backward()
                finally:
                    wrapped.enable_hooks()

    proofs: list[float] = []
    seconds, peak = measure(step, dev, repeats)
    row = {"engine": engine + ("-chunked" if chunked else ""), "V": V, "B": B, "d": d, "layers": layers, "T": T, "seconds": seconds,
           "peak_gib": peak, "device": device, "threads": torch.get_num_threads()}
    if dev.type == "cpu":
        row["tensor_peak_gib"] = tensor_peak(step, model)
    if proofs:  # the median guard over the measured steps (the first, a warm-up, left out), as a share of a step
        row.update(guard_seconds=statistics.median(proofs[1:] or proofs))
        row.update(guard_share=row["guard_seconds"] / seconds)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--V", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--B", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--T", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES + CHUNKED)
    parser.add_argument("--chunk", type=int, default=8192, help="the chunked head's vocabulary rows at a time")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--cell", nargs=2, metavar=("ENGINE", "V,B"), help=argparse.SUPPRESS)  # a child's one cell
    args = parser.parse_args(argv)
    if args.cell:
        V, B = (int(x) for x in args.cell[1].split(","))
        print(json.dumps(cell(args.cell[0], V, B, args.d, args.layers, args.T, args.repeats, args.device, args.chunk)))
        return []
    rows = []
    print(f"{'V':>7} {'B':>3} {'engine':<17} {'s/step':>8} {'x time':>7} {'peak GiB':>9} {'x memory':>9} {'guard':>7}"
          f" {'tensors GiB':>11} {'x tensors':>9}")
    for V in args.V:
        for B in args.B:
            base = chunk_base = None
            for engine in args.engines:
                cmd = [sys.executable, "-m", "benchmarks.clipping", "--cell", engine, f"{V},{B}", "--d", str(args.d),
                       "--layers", str(args.layers), "--T", str(args.T), "--repeats", str(args.repeats),
                       "--device", args.device, "--chunk", str(args.chunk)]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
                if proc.returncode != 0:
                    reason = (proc.stderr.strip().splitlines() or ["failed"])[-1][:80]
                    print(f"{V:>7} {B:>3} {engine:<17} failed: {reason}", flush=True)
                    rows.append({"engine": engine, "V": V, "B": B, "error": reason})
                    continue
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                base = row if engine == "non-private" else base
                chunk_base = row if engine == "non-private-chunked" else chunk_base
                if engine.endswith("-chunked") and chunk_base is not None:
                    row.update(chunked_time_ratio=row["seconds"] / chunk_base["seconds"],
                               chunked_memory_ratio=row["peak_gib"] / chunk_base["peak_gib"] if chunk_base["peak_gib"] > 0
                               else None)
                    if "tensor_peak_gib" in row:
                        row.update(chunked_tensor_ratio=row["tensor_peak_gib"] / chunk_base["tensor_peak_gib"])
                if base is not None and "tensor_peak_gib" in row:
                    row.update(tensor_ratio=row["tensor_peak_gib"] / base["tensor_peak_gib"])
                ratio_t = row["seconds"] / base["seconds"] if base else None
                ratio_m = row["peak_gib"] / base["peak_gib"] if base and base["peak_gib"] > 0 else None  # JSON: null
                row.update(time_ratio=ratio_t, memory_ratio=ratio_m)
                rows.append(row)
                shown = [f"{r:>6.2f}x" if r is not None else f"{'-':>7}" for r in (ratio_t, ratio_m)]
                guard = f"{row['guard_share']:>6.1%}" if "guard_share" in row else f"{'-':>6}"
                tensors = (f"{row['tensor_peak_gib']:>11.3f} {row['tensor_ratio']:>8.2f}x" if "tensor_ratio" in row
                           else f"{row.get('tensor_peak_gib', float('nan')):>11.3f} {'-':>9}")
                print(f"{V:>7} {B:>3} {engine:<17} {row['seconds']:>8.3f} {shown[0]} {row['peak_gib']:>9.3f} "
                      f"{shown[1]:>9} {guard:>7} {tensors}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
