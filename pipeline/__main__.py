"""``python -m pipeline [overrides] [-m]``: compose the config, validate it, run the cell."""

import sys

import hydra
from omegaconf import DictConfig

from pipeline import cell
from pipeline.config import ConfigError


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        cell.run(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
