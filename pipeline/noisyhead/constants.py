"""The numbers one NoisyHead cell runs with (``Constants``): what ``config.validate`` derives from the
config's rules, and what every later step (data, methods, evaluate, audit) takes. Apart from
``config`` so that the steps depend on it without depending on the validation, which reads their
registries (``data.DATASETS``, ``methods.ESTIMATORS``, ``attacks.ATTACKS``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

FLOAT_MAX = {"float64": 1.7976931348623157e308, "float32": 3.4028234663852886e38}  # torch.finfo(dtype).max, by compute.dtype


@dataclass(frozen=True)
class Constants:
    """The numbers one cell runs with, rules already applied."""

    N: int
    L: int
    D: int
    lam: float
    tau: float
    C: float
    G: float
    R: float
    eta0: float
    T: tuple[int, ...]  # one or more horizons; every T is its own private run
    init_scale: float
    sigma: float  # sensitivity constant of Theorem 3.2: 2 G (C + R G)

    def as_params(self) -> dict[str, object]:
        d = asdict(self)
        d["T"] = ",".join(str(t) for t in self.T)
        return d
