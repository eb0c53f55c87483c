"""`python -m pipeline +ensemble=caltech256 [overrides]`: train an ensemble
(mode=train), or profile its pipeline and write the report (mode=profile)."""
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipeline.config import register
from pipeline.report.profile_run import profile_run
from pipeline.run import ConfigError, run

register()

MODES = {"train": run, "profile": profile_run}


def run_mode(cfg: DictConfig, output_dir: Path) -> dict:
    if cfg.mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {cfg.mode!r}; set mode=train to train "
                          "the ensemble or mode=profile for a short profiling pass that writes the report")
    return MODES[cfg.mode](cfg, output_dir)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_mode(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
