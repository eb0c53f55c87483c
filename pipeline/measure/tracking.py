"""Experiment tracking: each member's metrics, epoch by epoch as the run goes, where tracking tools
read them. One CSV for the run (tracking/metrics.csv, a row per member and epoch) and, with
tracking.tensorboard, TensorBoard event files, one TensorBoard run per member (tracking/<member>/):
`tensorboard --logdir <run folder>/tracking`, or `--logdir <sweep folder>` for every job of a sweep.
A resumed run appends to both: an epoch trained again after a resume comes again, and its later
row is the one that stands."""
from __future__ import annotations

import csv
from pathlib import Path

FOLDER = "tracking"
CSV_FILE = "metrics.csv"
# metric (as RunRecorder.epoch_metrics names it) -> its TensorBoard tag
TAGS = {"train_loss": "train/loss", "val_accuracy": "val/accuracy", "val_loss": "val/loss", "lr": "train/lr",
        "images_per_s": "train/images_per_s", "data_stall_pct": "train/data_stall_pct"}


class Tracker:
    def __init__(self, run_dir: Path, tensorboard: bool):
        self.folder = run_dir / FOLDER
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / CSV_FILE
        new = not path.exists()
        self._file = path.open("a", newline="")
        self._csv = csv.writer(self._file)
        if new:
            self._csv.writerow(["model", "epoch", *TAGS])
        self._tensorboard = tensorboard
        self._writers: dict = {}  # member -> its SummaryWriter

    def epoch(self, model: str, epoch: int, metrics: dict[str, float | None]) -> None:
        """`model` has trained `epoch` epochs (1 after its first); `metrics`: RunRecorder.epoch_metrics."""
        self._csv.writerow([model, epoch, *("" if metrics[key] is None else repr(metrics[key]) for key in TAGS)])
        self._file.flush()  # a row a killed run measured stays
        if not self._tensorboard:
            return
        if model not in self._writers:
            from torch.utils.tensorboard import SummaryWriter  # 1.5 s of imports: only where it writes

            self._writers[model] = SummaryWriter(str(self.folder / model))
        writer = self._writers[model]
        for key, tag in TAGS.items():
            if metrics[key] is not None:
                writer.add_scalar(tag, metrics[key], epoch)
        writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._file.close()
