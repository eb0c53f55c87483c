"""Hydra callbacks: checks that must run before Hydra itself touches the disk."""
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pipeline.config import ConfigError, check_output_dir, exit_on_user_error
from pipeline.report.sweep import sweep_dir


class CheckOutputDir(Callback):
    """Hydra creates the run's folder and writes its .hydra files there before our code runs: check it first
    so that an unwritable place, or an earlier run's folder, gets our error (the path and the fix) while that
    run's files are whole. A sweep's folder may hold earlier jobs: each job's run checks its own."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _exit_on_error(Path(config.hydra.run.dir), fresh=not config.get("resume"))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _exit_on_error(sweep_dir(config), fresh=False)


def _exit_on_error(path: Path, fresh: bool) -> None:
    try:
        check_output_dir(path, fresh)
    except ConfigError as err:
        # Hydra turns a callback's exceptions into warnings and carries on: exit here.
        exit_on_user_error(err)
