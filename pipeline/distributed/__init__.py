"""DP-SGD across processes (shared machinery: it imports no task). ``DistributedDPSGD``
(``ddp.py``) is ``pipeline.dpsgd.DPSGD`` over ``torch.distributed`` with the model replicated:
one logical Poisson sample per step for the whole data set, each rank clipping its share exactly,
the clipped sums all-reduced, the Gaussian noise once per logical step (docs/dpsgd.md, "Across
processes")."""

from pipeline.distributed.ddp import DistributedDPSGD

__all__ = ["DistributedDPSGD"]
