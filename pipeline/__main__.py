"""`python -m pipeline +ensemble=caltech256 [overrides]`: train an ensemble
(mode=train), or profile its pipeline and write the report (mode=profile).

How it ends is its exit code (pipeline.config.ExitCode, the table in
docs/configuration.md). A user's mistake (stages.base.UserError: config,
slots, memory, dataset, a bad file under on_error=fail) is one message on
stderr and code 2; with HYDRA_FULL_ERROR=1 its traceback too. Ctrl-C or
SIGTERM stops the run in order (130, 143) and says how to resume it; so does
a run that lost hosts and has no slot left for its models (5). Errors
Hydra raises while composing the config keep Hydra's own message and code."""
import shlex
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipeline.config import ExitCode, exit_on_user_error, register
from pipeline.runtime.hang import HangError
from pipeline.runtime.lifetime import Interrupted, StopSignals
from pipeline.run import run
from stages.base import UserError

register()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    with StopSignals() as stop:
        try:
            results = run(cfg, Path(HydraConfig.get().runtime.output_dir), stop)
        except UserError as err:
            exit_on_user_error(err)
        except Interrupted as stopped:  # before training began: nothing to checkpoint or resume
            print(f"{stopped}: stopped before training began; nothing to resume", file=sys.stderr)
            sys.exit(128 + stopped.signum)
        except HangError as hung:  # a known condition, said in full: no traceback
            print(f"error: {hung}", file=sys.stderr)
            sys.exit(ExitCode.hung)
    if "interrupted" in results:
        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("resume=")]
        print(f"stopped ({results['interrupted']['cause']}); to resume: python -m pipeline "
              f"{shlex.join(overrides)} {results['interrupted']['resume']}", file=sys.stderr)
        sys.exit(128 + stop.signum if stop.signum else ExitCode.nodes_lost)
    if results.get("given_up"):
        sys.exit(ExitCode.models_given_up)


if __name__ == "__main__":
    main()
