"""The sweeper's cached composition (hydra_plugins/pipeline_sweeper/compose_cache.py) against
Hydra's own: every cell of every experiment's sweep, and the overrides a cache could get wrong."""

from pathlib import Path

import pytest
from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf

from hydra_plugins.pipeline_sweeper import compose_cache

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in ROOT.glob("conf/*/experiment/*.yaml"))
FIRST = 3  # the first cells of each sweep compared (Hydra composes one in about 0.1 s; the first is a cache miss)


@pytest.fixture
def loader():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield GlobalHydra.instance().config_loader()
    compose_cache._BASES.clear()
    compose_cache._REPOS.clear()


def _master(loader, *overrides):
    return loader.load_configuration("config", ["hydra.sweeper.sweep_id=test", *overrides], RunMode.MULTIRUN)


def _cells(loader, master, arguments):
    params = [f"{k}={v}" for k, v in (master.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(params + list(arguments))
    return [list(cell) for batch in BasicSweeper.split_arguments(parsed, None) for cell in batch]


def _same(fast, full):
    """Equal configs, unresolved (an interpolation stays one), with Hydra's flags on every node."""
    assert OmegaConf.to_container(fast, resolve=False) == OmegaConf.to_container(full, resolve=False)
    assert OmegaConf.is_struct(fast) == OmegaConf.is_struct(full)
    assert OmegaConf.is_readonly(fast.hydra) == OmegaConf.is_readonly(full.hydra)
    for key in ("method", "privacy", "model", "seqrec", "train"):
        if key in full:
            assert OmegaConf.is_struct(fast[key]) == OmegaConf.is_struct(full[key]), key


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_each_cell_of_each_experiments_sweep_composes_as_hydra_composes_it(loader, experiment):
    arguments = [f"experiment={experiment}", "hydra.sweep.dir=/tmp/sweep"]
    master = _master(loader, *arguments)
    cells = _cells(loader, master, arguments)
    cached = compose_cache.SweepConfigLoader(loader)
    for cell in cells[:FIRST]:
        _same(cached.load_sweep_config(master, cell), loader.load_sweep_config(master, cell))


def test_group_choices_values_additions_and_deletions_in_one_cell(loader):
    """Cells that change a group and a value inside it, add and force-add keys, delete one, set a
    dict, carry a Hydra override, and repeat a key (the last wins, as in Hydra); the second cell of
    each group choice comes from the cache."""
    master = _master(loader, "experiment=dpformer_ci", "hydra.sweep.dir=/tmp/sweep")
    cached = compose_cache.SweepConfigLoader(loader)
    cells = [
        ["experiment=dpformer_ci", "model=gru", "seqrec.lr=0.01", "model.d=8"],
        ["experiment=dpformer_ci", "model=gru", "seqrec.lr=0.03", "model.d=16"],
        ["experiment=dpformer_ci", "model=dpformer", "seqrec.lr=0.03", "+extra_key=1", "++seqrec.epochs=3"],
        ["experiment=dpformer_ci", "~trials", "privacy.eps=2", "privacy.eps=4"],
        ["experiment=dpformer_ci", "plot.colors={a: red}", "privacy.eps=8"],
        ["experiment=dpformer_ci", "hydra.job.name=x", "privacy.eps=8"],
        ["experiment=dpformer_ci", "privacy.eps='1e-3'", "seed=3"],
    ]
    for cell in cells:
        _same(cached.load_sweep_config(master, cell), loader.load_sweep_config(master, cell))
    assert len(compose_cache._BASES) == 4  # model=gru, model=dpformer, the preset alone and with hydra.job.name


def _either(loader, cached, master, cell):
    """The cached composition equals Hydra's, or fails with Hydra's error where Hydra's fails."""
    try:
        full = loader.load_sweep_config(master, cell)
    except Exception as expected:  # noqa: BLE001
        with pytest.raises(type(expected)) as got:
            cached.load_sweep_config(master, cell)
        assert str(got.value) == str(expected), cell
        return
    _same(cached.load_sweep_config(master, cell), full)


def test_overrides_of_every_kind_apply_in_the_cells_order(loader):
    """Hydra applies values, additions, deletions and dicts after composing, in the cell's order: a
    dict after a value of its key wins, a key added then deleted is gone, a value under a dict set
    later is refused."""
    master = _master(loader, "experiment=dpformer_ci", "hydra.sweep.dir=/tmp/sweep")
    cached = compose_cache.SweepConfigLoader(loader)
    for cell in (["experiment=dpformer_ci", "seqrec.lr=0.01", "seqrec={lr: 0.5}"],
                 ["experiment=dpformer_ci", "++seqrec.foo=1", "~seqrec.foo"],
                 ["experiment=dpformer_ci", "+seqrec.foo=1", "~seqrec.foo", "seqrec.lr=0.02"],
                 ["experiment=dpformer_ci", "plot.colors.a=blue", "plot.colors={a: red}"],
                 ["experiment=dpformer_ci", "~plot.colors", "model=gru"]):
        _either(loader, cached, master, cell)
    assert cached.load_sweep_config(master, ["experiment=dpformer_ci", "seqrec.lr=0.01", "seqrec={lr: 0.5}"]).seqrec.lr == 0.5


def test_a_bad_override_fails_as_in_hydra(loader):
    master = _master(loader, "experiment=fig1_lowdim", "hydra.sweep.dir=/tmp/sweep")
    cached = compose_cache.SweepConfigLoader(loader)
    for cell in (["privacy.epss=1"], ["+privacy.eps=1"], ["regime=nonesuch"], ["privacy.eps=[1"],
                 ["regime.N=10", "method@x=ridge"]):
        with pytest.raises(Exception) as expected:
            loader.load_sweep_config(master, cell)
        with pytest.raises(type(expected.value)) as got:
            cached.load_sweep_config(master, cell)
        assert str(got.value) == str(expected.value), cell


def test_a_cached_base_is_a_cells_own_and_kept_per_sweep_and_working_folder(loader, tmp_path, monkeypatch):
    cached = compose_cache.SweepConfigLoader(loader)
    first = _master(loader, "experiment=fig1_lowdim")
    a = cached.load_sweep_config(first, ["regime.N=1000", "privacy.eps=0.2"])
    a.seed = 99  # a cell's config is its own: the next cell, which does not set seed, keeps the default
    b = cached.load_sweep_config(first, ["regime.N=1000", "privacy.eps=0.5"])
    assert b.seed == 0 and b.privacy.eps == 0.5 and len(compose_cache._BASES) == 1
    monkeypatch.chdir(tmp_path)  # the same sweep from another working folder (hydra.runtime.cwd): its own base
    c = cached.load_sweep_config(first, ["regime.N=1000", "privacy.eps=0.2"])
    assert c.hydra.runtime.cwd == str(tmp_path) and len(compose_cache._BASES) == 2
    other = loader.load_configuration("config", ["hydra.sweeper.sweep_id=other", "experiment=fig1_lowdim"],
                                      RunMode.MULTIRUN)
    cached.load_sweep_config(other, ["regime.N=1000", "privacy.eps=0.2"])
    assert len(compose_cache._BASES) == 3
