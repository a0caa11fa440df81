"""What the GPU machine needs to run ``benchmarks/gpu_checks.sh`` and does not have: the wheels of
the project's runtime packages that its image lacks (the image's package list: ``IMAGE``, as the
device library's KINDS.md gives it, read 2026-11-17), with their own needs, at the versions this
environment has; and the Amazon Games file (``../shared`` does not travel to the device).

    python -m benchmarks.gpu_wheels            # list them, download into .whl/, copy the data into .gpu_data/
    python -m benchmarks.gpu_wheels --list     # only list

Each wheel is fetched for CPython 3.12 on manylinux x86-64 (the image's Python), without its
dependencies (each is named itself). A call to the device may carry 64 MiB in all: the script
fails if the wheels exceed ``LIMIT_MIB``. On the device: ``python3 -m pip install -q --no-index
--no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOTS = ["hydra-core", "omegaconf", "mlflow", "opacus", "dp-accounting", "submitit", "hydra-joblib-launcher",
         "hydra-submitit-launcher"]  # what the checks import that the image may lack
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio interface-meta iniconfig jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
yarl zipp""".split())
LIMIT_MIB = 60  # of the 64 MiB a call carries: the rest for the working tree
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """name -> version of every package the roots need (installed here), not extras, walking requirements."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux", "extra": "",
           "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "python_full_version": "3.12.3"}
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = norm(todo.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"error: {name} is needed but not installed here: install the project first") from None
        found[name] = dist.version
        for req in dist.requires or []:
            r = Requirement(req)
            if r.marker is None or r.marker.evaluate(env):
                todo.append(r.name)
    return found


def missing() -> dict[str, str]:
    """The closure less what the image has (its own versions are used for those)."""
    return {n: v for n, v in sorted(closure(ROOTS).items()) if n not in IMAGE}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="only list the wheels")
    parser.add_argument("--dest", default=".whl")
    parser.add_argument("--data", default="../shared/data/amazon-games-sasrec.txt", help="copied into .gpu_data/")
    args = parser.parse_args(argv)
    need = missing()
    for n, v in need.items():
        print(f"{n}=={v}")
    if args.list:
        return 0
    dest = Path(args.dest)
    dest.mkdir(exist_ok=True)
    wanted = {f"{norm(n)}-{v}" for n, v in need.items()}
    for stale in dest.glob("*.whl"):  # one version of each, and nothing else: two stop the device's install
        name, version = stale.name.split("-")[:2]
        if f"{norm(name)}-{version}" not in wanted:
            print(f"  removed {stale.name} (not needed)")
            stale.unlink()
    for n, v in need.items():
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)],
               "--platform", "any", "-d", str(dest), f"{n}=={v}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:  # no wheel published (antlr4-python3-runtime 4.9.3): build one, if it is pure Python
            built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest),
                                    f"{n}=={v}"], capture_output=True, text=True)
            pure = [w for w in dest.glob(f"{n.replace('-', '_')}-{v}-*.whl") if w.name.endswith("-none-any.whl")]
            if built.returncode or not pure:
                print(f"error: no wheel for {n}=={v}, and none could be built that runs on any platform",
                      file=sys.stderr)
                return 1
            print(f"  built {pure[0].name} (no wheel published; pure Python)")
    data = Path(args.data)
    if not data.is_file():
        print(f"error: --data: no such file {str(data)!r}", file=sys.stderr)
        return 1
    Path(".gpu_data").mkdir(exist_ok=True)
    copy = Path(".gpu_data") / data.name
    copy.write_bytes(data.read_bytes())
    wheels = sorted(dest.glob("*.whl"))
    total = (sum(w.stat().st_size for w in wheels) + copy.stat().st_size) / 2**20
    print(f"  {copy.stat().st_size / 2**20:6.1f} MiB  {copy} (the Amazon Games file)")
    for w in sorted(wheels, key=lambda w: -w.stat().st_size)[:8]:
        print(f"  {w.stat().st_size / 2**20:6.1f} MiB  {w.name}")
    print(f"{len(wheels)} wheels in {dest}/ and the data: {total:.1f} MiB (limit {LIMIT_MIB} MiB)")
    if total > LIMIT_MIB:
        print(f"error: they take {total:.1f} MiB, over the {LIMIT_MIB} MiB a device call can carry", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
