"""The summary a run prints at its end: the ensemble's models, the classes no usable image taught, the
objective and the pipeline's stages."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def print_summary(console: Console, results: dict) -> None:
    table = Table(title="Ensemble", title_justify="left")
    for column in ("model", "input", "group", "params", "slots", "val acc", "img/s", "data stall"):
        table.add_column(column, justify="left" if column in ("model", "input", "group") else "right")
    for m in results["models"]:
        group = f"{m['group']} ({m['group_mode']})" if m.get("group_mode") not in (None, "alone") else "-"
        table.add_row(m["name"], f"{m['input']} {m['image_size']}px", group, f"{m['params'] / 1e6:.2f}M",
                      str(m["slots"]), _pct(m["final_val_accuracy"]), _num(m["images_per_s"]),
                      _pct(m["data_stall_pct"], 1))
    ensemble = results["ensemble"]
    table.add_row("[bold]ensemble (mean softmax)", "", "", "", "", f"[bold]{_pct(ensemble['final_val_accuracy'])}",
                  "", "")
    kept = ensemble.get("kept")
    if kept:  # each member's best checkpoint, the models the run leaves
        table.add_row("ensemble, best checkpoints",
                      "", "", "", "", _pct(kept["val_accuracy"]), "", "")
    console.print(table)
    unusable = results["dataset"]["classes_without_training_images"]
    if unusable:
        console.print(f"[yellow]warning[/] {escape(no_training_images(unusable))}; fix those files (results.json: "
                      "skipped) or take the class out of the dataset")
    objective = results.get("objective")
    if objective:  # a training run's: what it returns to a Hydra sweeper
        value = "none (nothing validated)" if objective["value"] is None else f"{objective['value']:.4f}"
        console.print(f"[bold]objective[/] {objective['of']} {objective['metric']} = {value} "
                      f"({objective['direction']}; objective.of, objective.metric)")
    stages = Table(title="Pipeline stages (all epochs)", title_justify="left")
    for column in ("stage", "items", "CPU s", "CPU share", "items/s per core"):
        stages.add_column(column, justify="left" if column == "stage" else "right")
    for name, s in results["pipeline"]["stages"].items():
        stages.add_row(name, str(s["items"]), f"{s['cpu_s']:.2f}", _pct(s["cpu_share_pct"], 1),
                       _num(s["items"] / s["cpu_s"] if s["cpu_s"] > 1e-3 else None))
    console.print(stages)


def no_training_images(classes: list[str]) -> str:
    """The sentence that says every training file of `classes` was skipped, and what that means."""
    which, them = (f"class {classes[0]}", "it") if len(classes) == 1 else (f"classes {', '.join(classes)}", "them")
    return f"every training image of {which} was skipped: a model trained on this dataset cannot learn {them}"


def _pct(value: float | None, scale: float = 100) -> str:
    return "-" if value is None else f"{value * scale:.1f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"
