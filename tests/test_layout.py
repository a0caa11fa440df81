"""The layout's rules (docs/layout.md): the shared machinery (``pipeline/*.py``, ``hydra_plugins/``)
imports no task package, no task imports another, and no module of the pipeline imports itself
back through a circle. Read from the source (every ``import``, function-level ones included), so a
late import cannot hide an edge."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TASKS = sorted(p.name for p in (ROOT / "pipeline").iterdir() if (p / "task.py").is_file())


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for folder in ("pipeline", "hydra_plugins") for p in (ROOT / folder).rglob("*.py")
           if "__pycache__" not in p.parts}


def imports(path: Path) -> set[str]:
    """The project modules ``path`` imports, ``if TYPE_CHECKING:`` blocks included (``from
    pipeline.seqrec import data`` names the module ``pipeline.seqrec.data``; a name that is no module
    names its package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
    return {name for name in found if name in MODULES}


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def task_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "pipeline" and parts[1] in TASKS else None


def test_there_are_three_tasks_and_the_registry_names_them():
    from pipeline import tasks

    assert TASKS == ["lm", "noisyhead", "seqrec"]
    assert sorted(tasks.TASKS) == TASKS
    for name, module in tasks.TASKS.items():
        assert module == f"pipeline.{name}.task"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if task_of(m) is None))
def test_no_shared_module_imports_a_task(module):
    assert not {m for m in GRAPH[module] if task_of(m)}, f"{module} imports a task's module"


@pytest.mark.parametrize("task", TASKS)
def test_no_task_imports_another(task):
    other = {m for m in MODULES if task_of(m) == task for m in GRAPH[m] if task_of(m) not in (None, task)}
    assert not other, f"pipeline.{task} imports {sorted(other)}"


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of ``graph`` (depth-first search for a back edge), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_circle_finds_a_circle_and_only_a_circle():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circles():
    found = circle(GRAPH)
    assert found is None, "import circle: " + " -> ".join(found or [])


@pytest.mark.parametrize("task", TASKS)
def test_each_task_has_the_same_rooms(task):
    rooms = {"config", "data", "train", "evaluate", "plot", "cell", "sweep", "audit", "task"}
    have = {p.stem for p in (ROOT / "pipeline" / task).glob("*.py")}
    assert rooms <= have, f"pipeline/{task}/ lacks {sorted(rooms - have)}"
    assert (ROOT / "conf" / task).is_dir(), f"conf/{task}/ holds the task's config groups"


@pytest.mark.parametrize("task", TASKS)
def test_each_task_implements_the_interface(task):
    import importlib

    from pipeline.task import Task

    found = importlib.import_module(f"pipeline.{task}.task").TASK
    assert found.name == task
    for method in ("validate", "memory", "run_cell", "summarise", "audit"):
        assert callable(getattr(found, method)), method
    assert set(m for m in vars(Task) if not m.startswith("_")) >= {"validate", "memory", "run_cell", "summarise", "audit"}


def test_no_branch_on_a_task_name_outside_the_registry():
    """``if task == "seqrec"`` and its kin appear nowhere in the shared machinery."""
    for name, path in MODULES.items():
        if task_of(name) or name == "pipeline.tasks":
            continue
        text = path.read_text()
        for task in TASKS:
            for needle in (f'== "{task}"', f"== '{task}'", f'!= "{task}"', f"!= '{task}'"):
                assert needle not in text, f"{path.relative_to(ROOT)} branches on {needle}"
