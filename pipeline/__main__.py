"""`python -m pipeline +ensemble=caltech256 [overrides]`: train an ensemble
(mode=train), or profile its pipeline and write the report (mode=profile).

A user's mistake (stages.base.UserError: config, slots, memory, dataset, a
bad file under on_error=fail) is one message on stderr and exit code 2; with
HYDRA_FULL_ERROR=1 its traceback too. Errors Hydra raises while composing the
config keep Hydra's own message and exit code (docs/configuration.md)."""
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipeline.config import exit_on_user_error, register
from pipeline.run import run
from stages.base import UserError

register()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except UserError as err:
        exit_on_user_error(err)


if __name__ == "__main__":
    main()
