"""``python -m pipeline [overrides] [-m]``: compose the config, look up its task, run the cell."""

import sys

import hydra
from omegaconf import DictConfig

from pipeline.validation import ConfigError, RunFailed


def _in_a_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from pipeline import preflight, tasks  # here: a refused config does not wait for MLflow and plotting to load

    try:
        checked = preflight.checked(cfg)  # done once: before Hydra made the folder, or by the sweeper
        tasks.get(cfg).run_cell(cfg, checked)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except RunFailed as err:  # the run ended FAILED with the reason as a tag (pipeline.tracking.run)
        if _in_a_sweep():
            raise  # Hydra records the cell FAILED and the sweep goes on (SystemExit would stop the sweep)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as stop:  # Ctrl-C: the run ended KILLED (pipeline.tracking.run); no traceback
        from pipeline import tracking

        if isinstance(stop, tracking.Terminated):  # SIGTERM in a sweep's cell before its run began: as within one
            sys.exit(tracking.TERMINATED)
        print("error: interrupted (Ctrl-C); the run ended KILLED", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    from pipeline.overrides import unknown_choice, unknown_key

    if (message := unknown_choice(sys.argv[1:]) or unknown_key(sys.argv[1:])) is not None:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    main()
