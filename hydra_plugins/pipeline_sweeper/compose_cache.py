"""A sweep's cells composed once per choice of config groups: Hydra's ``load_sweep_config``, faster.

Hydra composes every cell of a sweep from scratch, twice (the sweeper validates it, the launcher
runs it): it reads and parses the YAML files, builds the defaults list and merges the configs, about
0.08 s a cell on two idle cores, where the cells of a sweep mostly differ in values (``regime.N``,
``privacy.eps``, ``seqrec.lr``) and share their config groups (``model``, ``dataset``). Composition
is, in Hydra's own order (``ConfigLoaderImpl._load_configuration_impl``):

1. the defaults list from the config-group overrides (a value override cannot change it: defaults
   lists interpolate only group choices), then the configs it names merged into one;
2. the value overrides applied to that config in their order (``_apply_overrides_to_config``);
3. ``hydra.overrides.task`` and ``hydra.job.override_dirname`` from the task overrides in their
   order.

``SweepConfigLoader.load_sweep_config`` does step 1 once per distinct set of the other overrides
(group choices and every ``hydra.*`` override), through Hydra itself, and then steps 2 and 3 on a
copy for each cell, every other override (values, additions, deletions, dicts) applied in the
cell's order as Hydra applies them. What it returns equals Hydra's composition of the cell
(``tests/test_compose_cache.py`` compares the first cells of every experiment's sweep, config and
flags, and cells that mix those kinds of override); anything it cannot take apart (an error, a sweep
value) is composed by Hydra as before, so errors read as Hydra's. The composed bases are kept per
process, sweep (its id), working folder and search path, so a joblib or submitit worker composes each
base once for all the cells it runs.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

_BASES: dict[tuple, DictConfig] = {}  # (sweep, config, other overrides) -> the composed base, per process
_REPOS: dict[tuple, Any] = {}  # (config, hydra overrides) -> Hydra's config repository (its search path) for them
_LIMIT = 64  # bases kept at most (a sweep of many group choices composes the rest as Hydra does)


class SweepConfigLoader:
    """Hydra's ConfigLoader with ``load_sweep_config`` composing each set of group choices once;
    everything else is the wrapped loader's."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # what this class does not define (not called for ``loader`` once set)
        if name.startswith("__") or name == "loader":  # pickling (joblib, submitit) looks these up before __init__ ran
            raise AttributeError(name)
        return getattr(self.loader, name)

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        overrides = list(sweep_overrides)
        config_name = master_config.hydra.job.config_name
        hydra_overrides = list(OmegaConf.to_container(master_config.hydra.overrides.hydra))
        try:
            parsed = OverridesParser.create().parse_overrides(overrides)
            where = (str(master_config.hydra.sweeper.get("sweep_id", "")), config_name, os.getcwd(),
                     tuple((p.provider, p.path) for p in self.loader.get_search_path().get_path()))
            repository = self._repository(where, hydra_overrides + [o.input_line for o in parsed
                                                                   if o.is_hydra_override()])
            values = [o for o in parsed if _is_value(o, repository)]
            if not values:
                return self.loader.load_sweep_config(master_config, overrides)
            others = [o.input_line for o in parsed if not any(o is v for v in values)]
            key = (*where, tuple(hydra_overrides), tuple(others))
            base = _BASES.get(key)
            if base is None:
                base = self.loader.load_sweep_config(master_config, others)
                if len(_BASES) >= _LIMIT:
                    _BASES.clear()
                _BASES[key] = base
            cfg = copy.deepcopy(base)
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)  # in the cell's order, as Hydra applies them
        except Exception:  # noqa: BLE001 -- Hydra's own composition, and its own error where there is one
            return self.loader.load_sweep_config(master_config, overrides)
        task = [o for o in parsed if not o.is_hydra_override()]
        with open_dict(cfg.hydra):
            cfg.hydra.overrides.task = [o.input_line for o in task]
            naming = cfg.hydra.job.config.override_dirname
            cfg.hydra.job.override_dirname = get_overrides_dirname(
                overrides=task, kv_sep=naming.kv_sep, item_sep=naming.item_sep, exclude_keys=naming.exclude_keys)
        OmegaConf.copy_cache(from_config=master_config, to_config=cfg)
        return cfg

    def _repository(self, where: tuple, hydra_overrides: list[str]) -> Any:
        """Hydra's config repository for this sweep, primary config, working folder and search path and
        these Hydra overrides (a ``hydra.searchpath`` among them changes where groups are found), as
        its composition builds it."""
        key = (*where, tuple(hydra_overrides))
        if key not in _REPOS:
            if len(_REPOS) >= _LIMIT:
                _REPOS.clear()
            _REPOS[key] = self.loader._parse_overrides_and_create_caching_repo(where[1], hydra_overrides)[1]
        return _REPOS[key]


def _is_value(override: Any, repository: Any) -> bool:
    """Whether Hydra applies the override to the composed config (its ``Overrides``: a dict, or a
    key that is no config group; deletions and additions included, in the cell's order), rather
    than using it to compose; ``hydra.*`` overrides, which may steer composition, are composed."""
    if override.is_hydra_override() or override.is_sweep_override():
        return False
    return isinstance(override.value(), dict) or not repository.group_exists(override.key_or_group)
