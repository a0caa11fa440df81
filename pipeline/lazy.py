"""Deferred imports for the modules a config's checks load: ``torch = lazy.module("torch")`` binds a
name that imports torch at its first use, not when the module holding it is imported.

Why: every refusal, ``--help`` and bad path runs the checks (``pipeline.preflight``) before anything
is computed, and importing torch alone takes 2-3 s of a process's start-up; a refused config needs
none of it. The first attribute read (``torch.zeros``) imports the real module, and every read after
it is one look-up in ``sys.modules``, so the module's own attributes (and what a test patches on
them) are always what is used. Modules that need torch at import time (an ``nn.Module`` subclass)
import it as usual.
"""

from __future__ import annotations

import importlib
import sys


class module:  # noqa: N801 (used like the module it stands for)
    """Stands for the module ``name``, importing it at the first attribute read."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str):
        name = object.__getattribute__(self, "_name")
        found = sys.modules.get(name)
        return getattr(found if found is not None else importlib.import_module(name), attr)

    def __setattr__(self, attr: str, value) -> None:
        raise AttributeError(f"set {attr} on the module {self._name} itself, not on its lazy stand-in")

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"
