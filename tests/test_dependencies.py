"""Every module imports, and every third-party package the code imports is declared in pyproject.toml.

A fresh machine has only what pyproject.toml declares: an import that works here because the
package came in by hand (or with another package) would fail for a new user. This test finds
every ``import`` statement (function-level ones included) in ``pipeline/``, ``hydra_plugins/``,
``benchmarks/`` and ``tests/``, maps each top-level third-party module to the distribution that
provides it, and requires that distribution among the project's requirements (``tests/`` may also
use the ``dev`` extra).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "hydra_plugins", "benchmarks")
LOCAL = {"pipeline", "hydra_plugins", "benchmarks", "tests"} | {p.stem for p in (ROOT / "tests").glob("*.py")}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normalise(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", r).group(1)) for r in requirements}


def declared() -> tuple[set[str], set[str]]:
    """(runtime, dev) distribution names from pyproject.toml."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = _requirement_names(project["dependencies"])
    dev = _requirement_names(project.get("optional-dependencies", {}).get("dev", []))
    return runtime, dev


def sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def imported_top_levels(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def third_party(names: set[str]) -> set[str]:
    return {n for n in names if n not in sys.stdlib_module_names and n not in LOCAL and n != "__future__"}


@functools.cache
def _providers() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def distributions_of(module: str) -> set[str]:
    return {_normalise(d) for d in _providers().get(module, [])}


def module_names() -> list[str]:
    names = []
    for path in sources(*PACKAGES):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.parametrize("module", module_names())
def test_every_module_imports(module):
    importlib.import_module(module)


@pytest.mark.parametrize("folder", [*PACKAGES, "tests"])
def test_third_party_imports_are_declared(folder):
    runtime, dev = declared()
    allowed = runtime | (dev if folder == "tests" else set())
    missing = {}
    for path in sources(folder):
        for module in third_party(imported_top_levels(path)):
            provided_by = distributions_of(module)
            if not provided_by:
                missing[module] = f"{path.relative_to(ROOT)}: no installed distribution provides it"
            elif not provided_by & allowed:
                missing[module] = f"{path.relative_to(ROOT)}: provided by {sorted(provided_by)}, not declared"
    assert not missing, "undeclared imports (add them to pyproject.toml):\n" + "\n".join(
        f"  {m}: {why}" for m, why in sorted(missing.items()))


def test_the_check_catches_an_undeclared_import(tmp_path):
    """The checker itself: a file importing a package that is installed here (as a dependency of
    a dependency) but not declared by the project is reported."""
    runtime, _ = declared()
    probe = tmp_path / "probe.py"
    probe.write_text("import numpy\nimport json\nfrom pipeline import cell\n\ndef f():\n    import sqlalchemy\n")
    found = third_party(imported_top_levels(probe))
    assert found == {"numpy", "sqlalchemy"}
    assert distributions_of("numpy") & runtime
    assert distributions_of("sqlalchemy") == {"sqlalchemy"} and not distributions_of("sqlalchemy") & runtime


@pytest.mark.slow
def test_a_bare_pytest_imports_our_benchmarks_not_opacuss(tmp_path):
    """opacus's wheel installs a top-level ``benchmarks`` package; a bare ``pytest`` (its console
    script: no working directory on sys.path) imported that one for ``benchmarks.seqrec_step``
    until pyproject.toml put the repository root on pytest's path."""
    script = Path(sys.executable).with_name("pytest")
    if not script.exists():
        pytest.skip(f"no pytest console script beside {sys.executable}")
    done = subprocess.run([str(script), "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_seqrec_step.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
