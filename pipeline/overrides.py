"""Config-group choices on the command line, checked against ``conf/`` before Hydra composes.

Hydra refuses an unknown option (``model=nosuch``) with its own multi-line message and exit
status 1; the pipeline's rule for bad input is one ``error:`` line naming the value and exit
status 2. This check covers plain choices, lists (``'method=[ridge,nosuch]'``) and sweeps
(``model=gru,nosuch``) of every group folder in ``conf/``; anything else (``+group=...``,
interpolations, a ``hydra/...`` group) is left to Hydra, which still refuses what is wrong.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

CONF = Path(__file__).resolve().parents[1] / "conf"
_CHOICE = re.compile(r"^(?:~|\+\+)?([a-z_]+)=(.*)$")


def options(group: str, conf: Path = CONF) -> list[str]:
    return sorted(p.stem for p in (conf / group).glob("*.yaml"))


def unknown_choice(argv: Sequence[str], conf: Path = CONF) -> str | None:
    """The error message for the first override choosing an option that ``conf/<group>/`` lacks, or None."""
    groups = {p.name for p in conf.iterdir() if p.is_dir()}
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
        known = options(group, conf)
        for choice in (v.strip() for v in value.split(",")):
            if choice and choice not in known:
                return f"{group}={choice!r} is not an option of conf/{group}/; options: {known}"
    return None
