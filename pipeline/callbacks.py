"""Hydra callbacks: checks that must run before Hydra itself touches the disk, or launches a job."""
from pathlib import Path
from typing import Any, Callable

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pipeline.config import ConfigError, check_output_dir, check_sweeper, exit_on_user_error, swept
from pipeline.report.sweep import sweep_dir


class CheckOutputDir(Callback):
    """Hydra creates the run's folder and writes its .hydra files there before our code runs: check it first
    so that an unwritable place, or an earlier run's folder, gets our error (the path and the fix) while that
    run's files are whole. A sweep's folder may hold earlier jobs: each job's run checks its own. The sweep's
    folder is held until the multirun's process ends."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _exit_on_error(check_output_dir, Path(config.hydra.run.dir), not config.get("resume"))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _exit_on_error(check_output_dir, sweep_dir(config), False)


class CheckSweeper(Callback):
    """A sweeper that optimises the other way than the objective's metric is refused once, before any
    job starts (under submitit, each would be a Slurm job that fails at once). Each job checks it again
    (pipeline/__main__.py): the only check where the metric is swept, or a launcher skips callbacks."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not swept(config, "objective.metric"):
            _exit_on_error(check_sweeper, config.objective, config.hydra.sweeper)


def _exit_on_error(check: Callable[..., None], *args: Any) -> None:
    try:
        check(*args)
    except ConfigError as err:
        exit_on_user_error(err)  # raised, Hydra would make it a warning and carry on
