"""Sweep summary for Hydra multiruns: a callback that, when every job is done,
compares the jobs side by side in sweep.html (self-contained) and sweep.csv."""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pipeline.report import plots
from pipeline.report.analysis import analyse
from pipeline.report.build import CSS

# column -> (title, unit) of the metrics compared across jobs
METRICS = {
    "images_per_s": ("input rate", "images/s"),
    "cpu_s_per_epoch": ("preprocessing CPU per epoch", "CPU-s"),
    "mean_stall_pct": ("mean data stall", "%"),
    "ensemble_accuracy": ("ensemble accuracy (final epoch)", "%"),
    "wall_s": ("end-to-end time", "s"),
}


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        html_path, csv_path = write_sweep_summary(Path(config.hydra.sweep.dir))
        print(f"sweep summary: {html_path}  {csv_path}")


@dataclass
class Job:
    folder: str  # relative to the sweep dir
    overrides: list[str]
    label: str  # the overrides that differ between jobs
    metrics: dict[str, float | None]
    verdict: str  # the report's bound, or why there is none


def write_sweep_summary(sweep_dir: Path) -> tuple[Path, Path]:
    jobs = read_jobs(sweep_dir)
    html_path, csv_path = sweep_dir / "sweep.html", sweep_dir / "sweep.csv"
    write_csv(jobs, csv_path)
    html_path.write_text(render_html(jobs, common_overrides([job.overrides for job in jobs])))
    return html_path, csv_path


def read_jobs(sweep_dir: Path) -> list[Job]:
    """Every job folder (Hydra leaves .hydra/overrides.yaml in each), in job order."""
    folders = sorted((p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml")), key=_job_order)
    overrides = {folder: list(yaml.safe_load((folder / ".hydra/overrides.yaml").read_text()) or [])
                 for folder in folders}
    common = common_overrides(list(overrides.values()))
    jobs = []
    for folder in folders:
        label = ", ".join(o for o in overrides[folder] if o not in common) or str(folder.relative_to(sweep_dir))
        metrics, verdict = _job_metrics(folder / "results.json")
        jobs.append(Job(str(folder.relative_to(sweep_dir)), overrides[folder], label, metrics, verdict))
    return jobs


def _job_order(folder: Path) -> tuple:
    # Hydra numbers job folders 0, 1, ... 10: order them as numbers, not as text.
    return tuple(int(part) if part.isdigit() else part for part in folder.parts)


def _job_metrics(results_path: Path) -> tuple[dict[str, float | None], str]:
    if not results_path.is_file():
        return dict.fromkeys(METRICS), "no results.json (the job failed or is still running)"
    results = json.loads(results_path.read_text())
    analysis = analyse(results)
    accuracy = results.get("ensemble", {}).get("final_val_accuracy")
    return {
        "images_per_s": analysis.images_per_s,
        "cpu_s_per_epoch": analysis.cpu_s_per_epoch,
        "mean_stall_pct": analysis.mean_stall_pct,
        "ensemble_accuracy": None if accuracy is None else 100 * accuracy,
        "wall_s": results.get("wall_s"),
    }, analysis.verdict.bound


def common_overrides(override_lists: list[list[str]]) -> list[str]:
    """The overrides every job shares (shown once, not in every job's label)."""
    if not override_lists:
        return []
    return [o for o in override_lists[0] if all(o in others for others in override_lists)]


def write_csv(jobs: list[Job], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["job", "overrides", *METRICS, "verdict"])
        for job in jobs:
            writer.writerow([job.folder, " ".join(job.overrides),
                             *("" if job.metrics[key] is None else f"{job.metrics[key]:.6g}" for key in METRICS),
                             job.verdict])


def render_html(jobs: list[Job], common: list[str]) -> str:
    labels = [job.label for job in jobs]
    charts = "".join(
        f"<img alt=\"{escape(title)}\" src=\"data:image/png;base64,"
        f"{plots.sweep_bar(labels, [job.metrics[key] for job in jobs], title, unit)}\">"
        for key, (title, unit) in METRICS.items()) if jobs else ""
    head = "".join(f"<th>{escape(h)}</th>" for h in ["job", "overrides", *(t for t, _ in METRICS.values()),
                                                        "verdict"])
    rows = "".join(
        "<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in
                         [job.folder, job.label, *(_cell(job.metrics[key]) for key in METRICS), job.verdict])
        + "</tr>" for job in jobs)
    shared = escape(" ".join(common)) or "(none)"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Sweep summary</title>"
            f"<style>{CSS} .charts {{ display: flex; flex-wrap: wrap; gap: 1em; }} "
            ".charts img { width: 370px; }</style></head><body>\n"
            f"<h1>Sweep summary: {len(jobs)} job(s)</h1>"
            f"<p class=\"note\">Overrides shared by every job: <code>{shared}</code>. Each job's own report is "
            "report.html in its folder.</p>"
            f"<div class=\"charts\">{charts}</div>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>\n</body></html>\n")


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.3g}"
