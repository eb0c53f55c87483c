"""`python -m pipeline +ensemble=caltech256 [overrides]`: train an ensemble
(mode=train), or profile its pipeline and write the report (mode=profile).

How it ends is its exit code (pipeline.config.ExitCode, the table in
docs/configuration.md). A user's mistake (pipeline.runtime.errors.UserError: config,
slots, memory, dataset, a bad file under on_error=fail) is one message on
stderr and code 2; with HYDRA_FULL_ERROR=1 its traceback too. Ctrl-C,
SIGTERM or a terminal's hangup stops the run in order (130, 143, 129) and says
how to resume it; so does its output's reader going away (`| head`: 141), and
a run that lost hosts and has no slot left for its models (5). Errors
Hydra raises while composing the config keep Hydra's own message and code.

`python -m pipeline -m ...` (a Hydra multirun) runs one job per combination, under the launcher
and sweeper Hydra's config names. A training job returns its objective (objective.of, objective.metric:
pipeline/measure/objective.py) to the sweeper. A job that fails for any reason above but a stop raises
JobFailed once it has said why: Hydra marks it failed, the sweeper decides whether the other jobs go on,
and the multirun's exit code is not 0. A stop (Ctrl-C, SIGTERM, ...) stops the whole multirun."""
import atexit
import gc
import shlex
import signal
import sys
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from pipeline.config import ExitCode, JobFailed, check_sweeper, exit_on_user_error, register
from pipeline.runtime.hang import HangError
from pipeline.runtime.lifetime import Interrupted, StopSignals
from pipeline.run import run
from pipeline.runtime.errors import UserError

register()
# The interpreter's exit collects every object the process holds (about a million after a run: torch, Dask,
# matplotlib), 1-2 s of a command's wall time for memory the OS frees at once. Frozen, they are left to it;
# the run has closed what it owns (processes, shared memory, sockets) before it returns.
atexit.register(gc.freeze)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    with StopSignals() as stop:
        try:
            stop.before_it_begins()
            if multirun:
                check_sweeper(cfg.objective, HydraConfig.get().sweeper)
            results = run(cfg, Path(HydraConfig.get().runtime.output_dir), stop)
        except UserError as err:
            if not multirun:
                exit_on_user_error(err)
            fail(ExitCode.user_error, f"error: {err}", multirun)
        except Interrupted as stopped:  # before training began: nothing to checkpoint or resume
            print(f"{stopped}: stopped before training began; nothing to resume", file=sys.stderr)
            sys.exit(128 + stopped.signum)
        except HangError as hung:  # a known condition, said in full: no traceback
            fail(ExitCode.hung, f"error: {hung}", multirun)
    if "interrupted" in results:
        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("resume=")]
        said = (f"stopped ({results['interrupted']['cause']}); to resume: python -m pipeline "
                f"{shlex.join(overrides)} {results['interrupted']['resume']}")
        if stop.signum:
            print(said, file=sys.stderr)
            sys.exit(128 + stop.signum)
        fail(ExitCode.nodes_lost, said, multirun)
    if stop.signum:  # asked to stop as the run, finished, closed: its results are whole; a multirun stops too
        print(f"{signal.Signals(stop.signum).name}: stopped as the run closed; it had finished and its results are "
              "written", file=sys.stderr)
        sys.exit(128 + stop.signum)
    if results.get("given_up"):
        fail(ExitCode.models_given_up, f"given up: {', '.join(results['given_up'])}", multirun)
    objective = results.get("objective")  # none in mode=profile
    return objective["value"] if objective else None


def fail(code: ExitCode, why: str, multirun: bool) -> NoReturn:
    """Say why; then exit with `code`, or in a multirun fail the job and let the sweeper go on."""
    print(why, file=sys.stderr)
    if multirun:
        raise JobFailed(code, why) from None  # why says it all: not the traceback of what it caught
    sys.exit(code)


if __name__ == "__main__":
    main()
