"""One rank of tests/test_distributed.py's runs: ``python tests/distributed_worker.py RANK WORLD INIT OUT
MAX_PHYSICAL_BATCH MODEL [C-by-rank]`` trains the shared tiny tied model with ``DistributedDPSGD`` over gloo for the
first of its two epochs and, on rank 0, saves the parameters and the checkpoint to OUT."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.distributed_model import MODELS, data  # noqa: E402


def main() -> None:
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    most = None if sys.argv[5] == "None" else int(sys.argv[5])
    make, loss_fn = MODELS[sys.argv[6]]
    C = 1.0 + rank if len(sys.argv) > 7 and sys.argv[7] == "C-by-rank" else 1.0  # a misuse the ranks must refuse
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from pipeline.dpsgd.distributed import DistributedDPSGD

    torch.manual_seed(100 + rank)  # different initial weights on every rank: rank 0's are broadcast
    dp = DistributedDPSGD(make(), data(), loss_fn, C=C, eps=4.0, delta=1e-5, batch_size=16, epochs=2,
                          max_physical_batch=most, seed=7)
    dp.epoch()  # the first of the plan's two epochs: the test resumes the second in one process
    dp.save(out / "ckpt.pt")
    if rank == 0:
        torch.save({k: v.detach() for k, v in dp.model.state_dict().items()}, out / "params.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
