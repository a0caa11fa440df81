"""One rank of tests/test_distributed.py's runs: ``python tests/distributed_worker.py RANK WORLD INIT OUT
MAX_PHYSICAL_BATCH MODEL [C-by-rank | fsdp]`` trains the shared tiny tied model with ``DistributedDPSGD`` over gloo for the
first of its two epochs and, on rank 0, saves the parameters and the checkpoint to OUT. ``fsdp``: the model sharded
by FSDP2 (``fully_shard`` on its units, ``distributed_model.UNITS``, and the whole), every rank's initial weights rank 0's,
its full parameters saved and the checkpoint's refusal checked."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.distributed_model import MODELS, UNITS, data  # noqa: E402


def main() -> None:
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    most = None if sys.argv[5] == "None" else int(sys.argv[5])
    make, loss_fn = MODELS[sys.argv[6]]
    extra = sys.argv[7] if len(sys.argv) > 7 else ""
    C = 1.0 + rank if extra == "C-by-rank" else 1.0  # a misuse the ranks must refuse
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from pipeline.dpsgd.distributed import DistributedDPSGD

    if extra == "fsdp":  # a sharded parameter is not broadcast: every rank makes rank 0's weights
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(100)
        model = make()
        mesh = init_device_mesh("cpu", (world,))
        for part in (*UNITS[sys.argv[6]](model), model):
            fully_shard(part, mesh=mesh)
    else:
        torch.manual_seed(100 + rank)  # different initial weights on every rank: rank 0's are broadcast
        model = make()
    dp = DistributedDPSGD(model, data(), loss_fn, C=C, eps=4.0, delta=1e-5, batch_size=16, epochs=2,
                          max_physical_batch=most, seed=7)
    dp.epoch()  # the first of the plan's two epochs: the test resumes the second in one process
    if extra == "fsdp":
        try:
            dp.save(out / "ckpt.pt")
            raise AssertionError("a sharded model's checkpoint was written")
        except NotImplementedError as refusal:
            assert "sharded by FSDP2" in str(refusal), refusal
        params = {k: v.full_tensor() for k, v in dp.model.named_parameters()}
        if rank == 0:
            torch.save(params, out / "params.pt")
    else:
        dp.save(out / "ckpt.pt")
        if rank == 0:
            torch.save({k: v.detach() for k, v in dp.model.state_dict().items()}, out / "params.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
