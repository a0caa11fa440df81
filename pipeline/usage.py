"""``python -m pipeline --help`` in a fraction of a second: Hydra's own app help, built faster.

Hydra's ``--help`` lists every config group by building a new config repository per group (150 of
them, each a deep copy of the search path's configs): 1-3 s on two cores for a page of text. This
module prints the same page (``hydra.help.template`` of ``conf/config.yaml``, filled in as Hydra fills
it: the header, the app's groups with their options, the composed config, the footer), listing the
groups from the config folders (``conf/`` and each task's ``conf/<task>/``, Hydra's search path) and
composing the config once. ``tests/test_cli.py`` checks that the page equals Hydra's, overrides
included. ``--hydra-help`` and every other flag stay Hydra's.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Sequence

from pipeline.overrides import ROOTS
from pipeline.tasks import CONF

FLAGS = ("--help", "-h")


def wanted(argv: Sequence[str]) -> bool:
    """Whether the command line asks for the app's help (and nothing Hydra alone understands)."""
    return any(a in FLAGS for a in argv) and all(a in FLAGS or not a.startswith("-") for a in argv)


def _groups(root: Path, prefix: str = "") -> dict[str, set[str]]:
    """Every folder under ``root`` holding YAML files, as Hydra names a group (``seqrec/model``), with
    its options."""
    found: dict[str, set[str]] = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        name = f"{prefix}{folder.name}"
        options = {p.stem for p in folder.glob("*.yaml")}
        if options:
            found.setdefault(name, set()).update(options)
        for group, more in _groups(folder, f"{name}/").items():
            found.setdefault(group, set()).update(more)
    return found


def app_groups() -> str:
    """Hydra's ``$APP_CONFIG_GROUPS``: one line per group of the search path, ``group: a, b, c``."""
    merged: dict[str, set[str]] = {}
    for root in ROOTS:  # conf/, then each task's conf/<task>/ (Hydra's search path)
        for group, options in _groups(root).items():
            merged.setdefault(group, set()).update(options)
    return "".join(f"{g}: {', '.join(sorted(merged[g]))}\n" for g in sorted(merged) if not g.startswith("hydra"))


def text(overrides: Sequence[str]) -> str:
    """The help page for these overrides (the config shown is the one they compose)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    template = cfg.hydra.help.template
    with open_dict(cfg):
        del cfg["hydra"]
    return string.Template(template).substitute(
        FLAGS_HELP="", HYDRA_CONFIG_GROUPS="", APP_CONFIG_GROUPS=app_groups(),
        CONFIG=OmegaConf.to_yaml(cfg, resolve=False))


def main(argv: Sequence[str]) -> None:
    print(text([a for a in argv if a not in FLAGS]))
