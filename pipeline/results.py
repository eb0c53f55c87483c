"""Collects what a run measured and writes results.json and the summary."""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from pipeline.graph import BatchOutput, StageTiming
from pipeline.planner import Placement


@dataclass
class ModelRecord:
    placement: Placement
    params: int
    image_size: int
    val_accuracy: dict[int, float] = field(default_factory=dict)
    train_loss: dict[int, float] = field(default_factory=dict)
    images: int = 0
    step_s: float = 0.0  # rank 0, summed over epochs
    wait_s: float = 0.0

    def as_dict(self) -> dict:
        m = self.placement.model
        epochs = sorted(self.val_accuracy)
        return {
            "name": m.name, "arch": m.arch, "depth": m.depth, "width": m.width, "growth_rate": m.growth_rate,
            "lr": m.lr, "input": m.input, "image_size": self.image_size, "params": self.params,
            "slots": len(self.placement.devices), "devices": list(self.placement.devices),
            "val_accuracy": [self.val_accuracy[e] for e in epochs],
            "final_val_accuracy": self.val_accuracy[epochs[-1]] if epochs else None,
            "train_loss": [self.train_loss[e] for e in sorted(self.train_loss)],
            "images_per_s": self.images / self.step_s if self.step_s else None,
            "data_stall_pct": 100 * self.wait_s / (self.wait_s + self.step_s) if self.step_s else None,
        }


class RunRecorder:
    def __init__(self, placements: list[Placement], params: dict[str, int], image_sizes: dict[str, int]):
        self.models = {p.model.name: ModelRecord(p, params[p.model.name], image_sizes[p.model.name])
                       for p in placements}
        self.stages: dict[str, StageTiming] = defaultdict(StageTiming)
        self.skipped: dict[str, str] = {}
        self.converted: dict[str, str] = {}
        self.val_probs: dict[int, dict[str, np.ndarray]] = defaultdict(dict)
        self.val_labels: dict[int, np.ndarray] = {}
        self.ensemble_accuracy: dict[int, float] = {}
        self.train_images = 0
        self.train_wall_s = 0.0
        self.new_skips: list[tuple[str, str]] = []

    def add_batch(self, output: BatchOutput, train: bool) -> None:
        for name, timing in output.timings.items():
            total = self.stages[name]
            total.wall_s += timing.wall_s
            total.cpu_s += timing.cpu_s
            total.items += timing.items
        if train:
            self.train_images += len(next(iter(output.streams.values())).labels)
        for path, reason in output.skipped:
            if path not in self.skipped:
                self.skipped[path] = reason
                self.new_skips.append((path, reason))
        self.converted.update(dict(output.converted))

    def take_new_skips(self) -> list[tuple[str, str]]:
        skips, self.new_skips = self.new_skips, []
        return skips

    def add_report(self, event: dict) -> int | None:
        """Folds a trainer report in; returns the epoch whose ensemble accuracy it completed."""
        record = self.models.get(event.get("model"))
        if event["event"] == "train" and event["rank"] == 0:  # rank 0 speaks for its model's ranks
            record.train_loss[event["epoch"]] = event["loss"]
            record.images += event["images"] * len(record.placement.devices)
            record.step_s += event["step_s"]
            record.wait_s += event["wait_s"]
        elif event["event"] == "val":
            epoch = event["epoch"]
            record.val_accuracy[epoch] = event["accuracy"]
            self.val_probs[epoch][event["model"]] = event["probs"]
            self.val_labels.setdefault(epoch, event["labels"])
            if not np.array_equal(self.val_labels[epoch], event["labels"]):
                raise RuntimeError(f"model {event['model']} saw validation labels in another order: "
                                   "streams are out of step")
            if len(self.val_probs[epoch]) == len(self.models):
                probs = np.mean(list(self.val_probs.pop(epoch).values()), axis=0)
                labels = self.val_labels[epoch]
                self.ensemble_accuracy[epoch] = float((probs.argmax(1) == labels).mean()) if len(labels) else float("nan")
                return epoch
        return None

    def as_dict(self, epochs: int) -> dict:
        models = [record.as_dict() for record in self.models.values()]
        finals = [m["final_val_accuracy"] for m in models if m["final_val_accuracy"] is not None]
        busy = sum(t.cpu_s for t in self.stages.values())
        return {
            "models": models,
            "ensemble": {
                "val_accuracy": [self.ensemble_accuracy[e] for e in sorted(self.ensemble_accuracy)],
                "final_val_accuracy": self.ensemble_accuracy.get(epochs - 1),
                "best_model_val_accuracy": max(finals) if finals else None,
            },
            "pipeline": {
                "train_images": self.train_images,
                "images_per_s": self.train_images / self.train_wall_s if self.train_wall_s else None,
                "cpu_s_per_epoch": busy / epochs if epochs else None,
                "stages": {name: {"wall_s": t.wall_s, "cpu_s": t.cpu_s, "items": t.items,
                                  "cpu_share_pct": 100 * t.cpu_s / busy if busy else None}
                           for name, t in self.stages.items()},
            },
            "skipped": [{"path": p, "reason": r} for p, r in sorted(self.skipped.items())],
            "converted": [{"path": p, "what": w} for p, w in sorted(self.converted.items())],
        }


def write_json(path: Path, results: dict) -> None:
    path.write_text(json.dumps(results, indent=2, default=str))


def print_summary(console: Console, results: dict) -> None:
    table = Table(title="Ensemble", title_justify="left")
    for column in ("model", "input", "params", "slots", "val acc", "img/s", "data stall"):
        table.add_column(column, justify="left" if column in ("model", "input") else "right")
    for m in results["models"]:
        table.add_row(m["name"], f"{m['input']} {m['image_size']}px", f"{m['params'] / 1e6:.2f}M", str(m["slots"]),
                      _pct(m["final_val_accuracy"]), _num(m["images_per_s"]), _pct(m["data_stall_pct"], 1))
    ensemble = results["ensemble"]
    table.add_row("[bold]ensemble (mean softmax)", "", "", "", f"[bold]{_pct(ensemble['final_val_accuracy'])}", "", "")
    console.print(table)
    stages = Table(title="Pipeline stages (all epochs)", title_justify="left")
    for column in ("stage", "items", "CPU s", "CPU share", "items/s per core"):
        stages.add_column(column, justify="left" if column == "stage" else "right")
    for name, s in results["pipeline"]["stages"].items():
        stages.add_row(name, str(s["items"]), f"{s['cpu_s']:.2f}", _pct(s["cpu_share_pct"], 1),
                       _num(s["items"] / s["cpu_s"] if s["cpu_s"] > 1e-3 else None))
    console.print(stages)


def _pct(value: float | None, scale: float = 100) -> str:
    return "-" if value is None else f"{value * scale:.1f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
