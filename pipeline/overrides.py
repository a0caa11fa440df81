"""The command line's overrides, checked before Hydra composes: config-group choices against the
config folders (``unknown_choice``), and keys against the composed config (``unknown_key``).

Hydra refuses an unknown option (``model=nosuch``) or key (``privacy.epss=0.2``) with its own
multi-line message and exit status 1; the pipeline's rule for bad input is one ``error:`` line
naming the key and value and exit status 2. The choice check covers plain choices, lists
(``'method=[ridge,nosuch]'``) and sweeps (``model=gru,nosuch``) of every group folder in
``conf/`` and the tasks' ``conf/<task>/`` (the search path: ``pipeline.tasks.conf_dirs``); the key
check composes the sweep's first cell. An override Hydra cannot read, a sweep without ``-m``
(``syntax``) and a key given twice with two values (``repeated``) are refused first. Anything else
(``+group=...``, interpolations, a ``hydra/...`` group or ``hydra.*`` key) is left to Hydra, which
still refuses what is wrong.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Sequence

from pipeline import tasks
from pipeline.tasks import CONF, conf_dirs

_CHOICE = re.compile(r"^(?:~|\+\+)?([a-z_]+)=(.*)$")
_GROUP = re.compile(r"^(?:\+\+|\+)?([a-z_]+)=")  # a group chosen or added (Hydra's advice: +model=...)
ROOTS = (CONF, *conf_dirs())  # the shared groups' folder, then each task's (Hydra's search path)


def options(group: str) -> list[str]:
    return sorted({p.stem for root in ROOTS for p in (root / group).glob("*.yaml")})


def folders(group: str) -> str:
    """Where a group's files live, relative to the repository (``conf/seqrec/model/``)."""
    return ", ".join(f"{(root / group).relative_to(CONF.parent).as_posix()}/" for root in ROOTS if (root / group).is_dir())


def unknown_choice(argv: Sequence[str]) -> str | None:
    """The error message for the first override choosing an option that no folder of its group has, or None."""
    tasks = {root.name for root in ROOTS[1:]}
    groups = {p.name for root in ROOTS for p in root.iterdir() if p.is_dir()} - tasks
    for arg in argv:
        match = _CHOICE.match(arg)
        if not match or match.group(1) not in groups:
            continue
        group, value = match.groups()
        value = value.strip()
        if value.startswith("[") and value.endswith("]"):
            value = value[1:-1]
        if value == "null" and not arg.startswith("~"):
            return (f"{group}=null: a config group takes one of its options {options(group)}; to drop the group, "
                    f"use ~{group}")
        if value in ("", "null") or "$" in value or "(" in value:
            continue  # an empty list, no choice, an interpolation or a sweep function: Hydra's to judge
        known = options(group)
        for choice in (v.strip() for v in value.split(",")):
            if choice and choice not in known:
                close = difflib.get_close_matches(choice, known, n=1)
                hint = f"; did you mean {group}={close[0]}?" if close else ""
                return f"{group}={choice!r} is not an option of {folders(group)}; options: {known}{hint}"
    return None


def _homes(group: str, option: str) -> list[str]:
    """The tasks whose folder ``conf/<task>/<group>/`` has ``option``, or [""] where the shared
    ``conf/<group>/`` has it (every task's then)."""
    if (CONF / group / f"{option}.yaml").is_file():
        return [""]
    return [root.name for root in ROOTS[1:] if (root / group / f"{option}.yaml").is_file()]


def _task(argv: Sequence[str]) -> str | None:
    """The task the command line runs: ``task=NAME``, else the task whose folder holds the chosen
    experiment, else the default; None where one command line runs several (a sweep over them)."""
    chosen = {}
    for arg in argv:
        match = _CHOICE.match(arg)
        if match and match.group(1) in ("task", "experiment"):
            chosen[match.group(1)] = match.group(2).strip()
    if "task" in chosen:
        return chosen["task"] if chosen["task"] in tasks.TASKS else None
    experiment = chosen.get("experiment", "null")
    if experiment in ("", "null"):
        return tasks.DEFAULT
    homes = {root.name for root in ROOTS[1:] for e in experiment.split(",") if (root / "experiment" / f"{e}.yaml").exists()}
    return homes.pop() if len(homes) == 1 else None


def _named_key(task: str, group: str) -> str | None:
    """Where a task's experiment presets set ``group`` as a mapping with a ``name`` (the language
    model's ``clipping: {name: phantom, C: 1.0}``): that file, relative to the repository, or None."""
    import yaml

    for path in sorted((CONF / task / "experiment").glob("*.yaml")):
        node = yaml.safe_load(path.read_text()) or {}
        if isinstance(node.get(group), dict) and "name" in node[group]:
            return path.relative_to(CONF.parent).as_posix()
    return None


def other_tasks_group(argv: Sequence[str]) -> str | None:
    """The error message for the first override choosing an option that only other tasks' folders
    have (``model=dpformer`` in a NoisyHead run: Hydra's advice, +model=dpformer, ran NoisyHead and
    ignored it; ``regime=highdim`` in a DPFormer run was ignored too; ``model=dpformer`` in a
    language-model run, whose own ``model`` group has other options), or None. Groups are judged by
    option, not by name: several tasks have a ``model`` or a ``dataset`` group."""
    task = _task(argv)
    if task is None:
        return None
    for arg in argv:
        match = _GROUP.match(arg)
        if not match or match.group(1) in ("task", "experiment"):
            continue
        group = match.group(1)
        value = arg.split("=", 1)[1].strip()
        if value.startswith("[") and value.endswith("]"):
            value = value[1:-1]
        if "$" in value or "(" in value:
            continue
        for choice in (v.strip() for v in value.split(",")):
            homes = _homes(group, choice) if choice and choice != "null" else []
            if not homes or "" in homes or task in homes:
                continue
            other = homes[0]
            # the task's quickest preset (``*_ci``) first: the one a user trying the option should run
            presets = sorted((p.stem for p in (CONF / other / "experiment").glob("*.yaml")),
                             key=lambda e: (not e.endswith("_ci"), e))
            hint = (f"choose one of its experiments with it ({', '.join(f'experiment={e}' for e in presets[:3])}, "
                    f"...: conf/{other}/experiment/)" if other != tasks.DEFAULT else "drop it")
            own = sorted(p.stem for p in (CONF / task / group).glob("*.yaml"))
            named = _named_key(task, group)
            if named:  # the running task sets it as a key (the language model's clipping.name), not a group
                return (f"{arg}: {choice} is an option of the config group {group} of task="
                        f"{' and task='.join(homes)} only; this command runs task={task}, which chooses it with "
                        f"the key {group}.name: use {group}.name={value} ({named})")
            runs = (f"whose {group} options are {own}" if own else "which would ignore it")
            owners = " and ".join(f"task={h}" for h in homes)
            return (f"{arg}: {choice} is an option of the config group {group} of {owners} only "
                    f"({', '.join(f'conf/{h}/{group}/' for h in homes)}), and this command runs task={task}, "
                    f"{runs}; {hint}")
    return None


def repeated(argv: Sequence[str]) -> str | None:
    """The error message for the first key or group given twice with different values
    (``privacy.eps=0.5 privacy.eps=0.2``, ``model=dpformer model=transformer``), or None. Hydra takes
    the last without a word, so a sweep launched that way ran cells nobody asked for; the same
    override twice changes nothing and passes."""
    seen: dict[str, str] = {}
    for arg in argv:
        key, sep, _ = arg.partition("=")
        if not sep or arg.startswith("-"):
            continue
        key = key.lstrip("+~")
        if key in seen and seen[key] != arg:
            return (f"{key} is given twice ({seen[key]}, then {arg}): give it once (several values are a sweep: "
                    f"{key}=a,b with -m)")
        seen[key] = arg
    return None


def syntax(argv: Sequence[str], sweeps: bool = True) -> str | None:
    """The error message for the first override Hydra cannot read (``privacy.eps=[0.2``, ``foo``), or
    for a sweep (``privacy.eps=0.2,0.5``, ``range(1,3)``) without ``-m``, or None: Hydra's own text is
    several lines and exit status 1. ``sweeps=False``: an entry point that runs one config (the
    audit), where a sweep is refused whatever the flags. Command lines with other flags than ``-m``
    are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(a.startswith("-") and a not in FLAGS for a in argv):
        return None
    multirun = sweeps and any(a in FLAGS for a in argv)
    parser = OverridesParser.create()
    for arg in (a for a in argv if a not in FLAGS):
        try:
            override = parser.parse_override(arg)
        except Exception as err:  # noqa: BLE001 -- Hydra's parse errors (HydraException and its subclasses)
            said = (str(err).strip().splitlines() or ["no message"])[-1]
            return (f"{arg}: Hydra cannot read this override ({said}): write key=value; a list key=[a,b]; a value "
                    f"with spaces, commas or brackets in quotes: key='a, b'")
        if override.is_sweep_override() and not multirun:
            key = override.get_key_element()
            if not sweeps:
                return (f"{arg}: {key} is given several values, and this command runs one config: give one value "
                        f"(a list: {key}=[...]; a string with commas: {key}='...')")
            return (f"{arg}: several values of {key} are a sweep: add -m to run one cell each (python -m pipeline ... "
                    f"{arg} -m); a list is {key}=[...], a string with commas {key}='...'")
    return None


FLAGS = ("-m", "--multirun")  # the command-line flags the key check passes over; with any other, Hydra's to judge


def checkout(folder: Path) -> bool:
    """Whether ``folder`` is the root of a checkout of this project (its entry point and config)."""
    return (folder / "pipeline" / "__main__.py").is_file() and (folder / "conf" / "config.yaml").is_file()


def subfolder(cwd: Path | None = None) -> str | None:
    """The error message for a command started in a folder inside a checkout (``cd docs && python -m
    pipeline``), or None: the default MLflow store (``./mlflow.db``, ``./mlruns``), ``outputs/`` and the
    data paths (``../shared/...``) are relative to the working directory, so such a run made a second
    store and outputs there, and the UI's links opened whichever store a ``mlflow ui`` served."""
    cwd = (cwd or Path.cwd()).resolve()
    root = next((p for p in cwd.parents if checkout(p)), None)
    if root is None or checkout(cwd):
        return None
    return (f"the working directory {cwd} is inside the repository {root}: run from its root (cd {root}), where the "
            f"default MLflow store (mlflow.db, what `mlflow ui` started there shows), outputs/ and the data paths are")


def _compose(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name, overrides=overrides)


def _added_typo(parsed, composed) -> str | None:
    """The error message for a ``+section.key=value`` that adds a key beside a close existing one
    (``+privacy.epsilon=0.01`` beside ``privacy.eps``: Hydra adds it, no code reads it, and the run
    went on at the default eps), or None. A key with no close neighbour is added as asked."""
    import difflib

    from omegaconf import DictConfig, OmegaConf

    for o in parsed:
        line = o.input_line or ""
        if not line.startswith("+") or line.startswith("++") or "." not in o.key_or_group:
            continue
        parent, _, leaf = o.key_or_group.rpartition(".")
        node = OmegaConf.select(composed, parent)
        if not isinstance(node, DictConfig):
            continue
        keys = sorted(str(k) for k in node.keys() if str(k) != leaf)
        close = difflib.get_close_matches(leaf, keys, n=1)
        if close:
            return (f"{line}: {o.key_or_group} is not a key of the config ({parent} has: {', '.join(keys)}); "
                    f"did you mean {parent}.{close[0]}? (+ adds a key that nothing reads)")
    return None


def unknown_key(argv: Sequence[str], config_name: str = "config") -> str | None:
    """The error message for an override that sets a key the composed config does not have
    (``privacy.epss=0.2``: Hydra's "Could not override"), with the keys beside it and the closest,
    or that adds one beside a close existing key (``+privacy.epsilon=0.01``), or None. Composes the
    first cell of a sweep (each swept value's first), about 0.1 s."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    if any(a.startswith("-") and a not in FLAGS for a in argv):
        return None
    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if a not in FLAGS])
    except Exception:  # a syntax error: Hydra's message says where
        return None
    first: list[str] = []
    choices: list[tuple[str, str]] = []  # (key, line): the overrides that choose the config's shape
    for o in parsed:
        if o.key_or_group.startswith("hydra"):
            continue
        if o.is_sweep_override():
            try:  # the first value only: a range is listed lazily (range(0,10000000000) would fill the memory)
                value = next(iter(o.sweep_string_iterator()), None) if o.is_discrete_sweep() else None
            except Exception:  # a sweep function Hydra evaluates later (glob): Hydra's to judge
                return None
            if value is None:
                return None
            line = f"{o.get_key_element()}={value}"
        else:
            line = o.input_line
        first.append(line)
        if "." not in o.key_or_group or o.get_key_element()[:1] in "+~":
            choices.append((o.key_or_group, line))
    try:
        composed = _compose(config_name, first)
        return _added_typo(parsed, composed)
    except ConfigCompositionException as err:
        found = re.match(r"Could not override '([^']+)'", str(err))
        if not found or not isinstance(err.__cause__, (ConfigAttributeError, ConfigKeyError)):
            return None
        key = found.group(1)
    except Exception:
        return None
    line = next(o.input_line for o in parsed if o.key_or_group == key)
    parent, _, leaf = key.rpartition(".")
    shape = [line for k, line in choices if k != key]  # a top-level key (bogus=1) would fail the shape too
    try:  # the config's shape without any value override (another may be a typo too)
        node = OmegaConf.select(_compose(config_name, shape), parent) if parent else _compose(config_name, shape)
    except Exception:
        node = None
    if node is not None and not isinstance(node, DictConfig):
        return f"{line}: {key} is not a key of the config ({parent} is a value, not a section of keys)"
    if node is None:
        return f"{line}: {key} is not a key of the config ({parent} is not one either); to add it, use +{line}"
    keys = sorted(str(k) for k in node.keys())
    close = difflib.get_close_matches(leaf, keys, n=1)
    hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
    where = f"{parent} has" if parent else "the config has"
    return f"{line}: {key} is not a key of the config ({where}: {', '.join(keys)}){hint}"
