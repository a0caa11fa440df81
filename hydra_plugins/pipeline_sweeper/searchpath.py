"""Each task's config groups on Hydra's search path: ``conf/noisyhead/`` (regime, attack, method,
dataset, experiment) and ``conf/seqrec/`` (model, clipping, train, dataset, experiment) beside the
shared ``conf/`` (config.yaml, audit.yaml, privacy). Groups of the same name merge, so a choice
reads as before (``regime=highdim``, ``model=dpformer``, ``experiment=dpformer_ci``) while its
file lives with its task. Hydra finds this plugin in ``hydra_plugins``, for ``@hydra.main`` and
``compose()`` alike."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class TaskConfigs(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from pipeline.tasks import conf_dirs

        for folder in conf_dirs():
            search_path.append(provider=f"pipeline-{folder.name}", path=f"file://{folder}")
