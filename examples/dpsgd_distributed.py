"""DP-SGD across processes on a Hugging Face GPT-2 (tied input and output embeddings), replicated (DDP's
layout) or sharded by FSDP2, on the CPU over gloo or on GPUs over NCCL:

    torchrun --nproc-per-node 2 examples/dpsgd_distributed.py                 # replicated
    torchrun --nproc-per-node 2 examples/dpsgd_distributed.py --mode fsdp     # sharded (fully_shard)

from the repository root (nothing is downloaded: the model is built from a config with random weights,
the data are random token sequences). ``pipeline.dpsgd.distributed.DistributedDPSGD`` draws one Poisson
sample per step over the whole data set, clips each rank's share exactly (Phantom Clipping), sums the
clipped gradients across the ranks and adds the noise once: the same run, the same eps, as one process
(``docs/dpsgd.md``, "Across processes"). Rank 0 prints; ``--compare`` also trains one process on rank 0
and prints the largest difference of the parameters.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from pipeline.dpsgd import DPSGD  # noqa: E402
from pipeline.dpsgd.distributed import DistributedDPSGD  # noqa: E402


def loss_fn(model, ids: torch.Tensor) -> torch.Tensor:
    """Each example's next-token loss, (n,)."""
    n, T = ids.shape
    logits = model(input_ids=ids, position_ids=torch.arange(T, device=ids.device).expand(n, T)).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").sum(1)


def gpt2(device: torch.device):
    """The same weights on every rank (FSDP2 shards what each rank made; the replicated mode broadcasts
    rank 0's anyway)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1000, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).double().to(device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("replicated", "fsdp"), default="replicated")
    parser.add_argument("--examples", type=int, default=128, help="the private data set: this many sequences")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--eps", type=float, default=8.0)
    parser.add_argument("--compare", action="store_true", help="also train one process on rank 0 and compare")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets the rank and the world size
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.set_num_threads(1)
    data = torch.randint(0, 1000, (args.examples, 16), generator=torch.Generator().manual_seed(1)).to(device)
    settings = dict(eps=args.eps, delta=1e-5, batch_size=args.examples // 4, epochs=args.epochs, C=1.0, lr=1e-3,
                    max_physical_batch=8, seed=0)
    model = gpt2(device)
    if args.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.transformer.h:  # each block a unit; the tied table stays one Parameter, in the root's
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    dp = DistributedDPSGD(model, data, loss_fn, **settings)
    epochs = dp.fit(log_every=None)
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
              for k, v in model.named_parameters()}
    out = {"mode": args.mode, "world": world, "steps": dp.steps_done, "eps_spent": dp.eps_spent(),
           "final_loss": epochs[-1].loss}
    if rank == 0:
        print(f"{args.mode} on {world} ranks: {dp.steps_done} steps, loss {epochs[-1].loss:.4f}, "
              f"eps spent {dp.eps_spent():.3f} at delta = 1e-5", flush=True)
        if args.compare:
            one = gpt2(device)
            DPSGD(one, data, loss_fn, **settings).fit(log_every=None)
            want = dict(one.named_parameters())
            out["max_difference"] = max(float((params[k] - want[k].detach().cpu()).abs().max()) for k in params)
            print(f"one process: largest parameter difference {out['max_difference']:.3g}", flush=True)
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
