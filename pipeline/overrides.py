"""Config-group choices on the command line, checked against the config folders before Hydra composes.

Hydra refuses an unknown option (``model=nosuch``) with its own multi-line message and exit
status 1; the pipeline's rule for bad input is one ``error:`` line naming the value and exit
status 2. This check covers plain choices, lists (``'method=[ridge,nosuch]'``) and sweeps
(``model=gru,nosuch``) of every group folder in ``conf/`` and the tasks' ``conf/<task>/`` (the
search path: ``pipeline.tasks.conf_dirs``); anything else (``+group=...``,
interpolations, a ``hydra/...`` group) is left to Hydra, which still refuses what is wrong.
"""

from __future__ import annotations

import re
from typing import Sequence

from pipeline.tasks import CONF, conf_dirs

_CHOICE = re.compile(r"^(?:~|\+\+)?([a-z_]+)=(.*)$")
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
        if value in ("", "null") or "$" in value or "(" in value:
            continue  # an empty list, no choice, an interpolation or a sweep function: Hydra's to judge
        known = options(group)
        for choice in (v.strip() for v in value.split(",")):
            if choice and choice not in known:
                return f"{group}={choice!r} is not an option of {folders(group)}; options: {known}"
    return None
