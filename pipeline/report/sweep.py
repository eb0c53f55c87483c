"""Sweep summary for Hydra multiruns: a callback that records each job's overrides
and how it ended (job.json in its folder: running, completed with its objective,
or failed and why) and compares the jobs side by side in sweep.html
(self-contained) and sweep.csv, written again as each job ends (so a sweep that
stops at a failed batch keeps one) and once every job is done."""
from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import json
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from pipeline.measure.tracking import CSV_FILE as TRACKING_CSV, FOLDER as TRACKING
from pipeline.report import plots
from pipeline.report.analysis import analyse
from pipeline.report.build import CSS
from pipeline.runtime.files import write_whole

# in a job's folder: {"overrides": [...], "status": "running" | "completed" | "failed", "objective" | "error": ...}
JOB_FILE = "job.json"

# column -> (title, unit) of the metrics compared across jobs
METRICS = {
    "objective": ("objective (what the job returned)", ""),
    "images_per_s": ("input rate", "images/s"),
    "cpu_s_per_epoch": ("preprocessing CPU per epoch", "CPU-s"),
    "mean_stall_pct": ("mean data stall", "%"),
    "ensemble_accuracy": ("ensemble accuracy (final epoch)", "%"),
    "wall_s": ("end-to-end time", "s"),
}


class SweepSummary(Callback):
    """In the job's own process, whatever the launcher: its job.json as it starts and as it ends."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            _record(config, {"status": "running"})

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        _record(config, job_outcome(job_return))
        write_sweep_summary(sweep_dir(config))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        html_path, csv_path, best = write_sweep_summary(sweep_dir(config))
        print(f"sweep summary: {html_path}  {csv_path}\n{best}")


def sweep_dir(config: DictConfig) -> Path:
    """A multirun's folder (hydra.sweep.dir), absolute: where the jobs run in folders of their own
    (hydra.job.chdir=true), a relative one would name a folder inside each job's."""
    return Path(config.hydra.runtime.cwd, str(config.hydra.sweep.dir))


def _record(config: DictConfig, outcome: dict) -> None:
    """The job's job.json: its overrides (Hydra's own copy, .hydra/, may be off: hydra.output_subdir=null)
    and `outcome`."""
    record = {"overrides": list(config.hydra.overrides.task), **outcome}
    write_whole(Path(config.hydra.runtime.output_dir) / JOB_FILE, json.dumps(record))


def job_outcome(job_return: JobReturn) -> dict:
    if job_return.status == JobStatus.COMPLETED:
        value = job_return.return_value
        return {"status": "completed", "objective": value if isinstance(value, (int, float)) else None}
    try:
        # A failed job's return value raises what failed it, after writing "Error executing job" to
        # stderr, which the sweeper does again when it reads it.
        with contextlib.redirect_stderr(io.StringIO()):
            job_return.return_value
    except Exception as failure:
        return {"status": "failed", "error": f"{type(failure).__name__}: {failure}"}
    raise AssertionError(f"a job that did not complete returned: {job_return.status}")


@dataclass
class Job:
    folder: str  # relative to the sweep dir
    overrides: list[str]
    label: str  # the overrides that differ between jobs
    metrics: dict[str, float | None]
    verdict: str  # the report's bound, or why there is none
    measure: tuple[str, str, str] | None  # its objective's (of, metric, direction); None unless it completed


def best_job(jobs: list[Job]) -> tuple[Job | None, str]:
    """The completed job with the best objective, by its direction (the first of equals), and one line
    saying so; None, and the line saying why, when no job returned one or when the jobs' objectives
    measure different things (a sweep over objective.of or objective.metric: no value is better)."""
    scored = [job for job in jobs if job.measure and job.metrics["objective"] is not None]
    if not scored:
        return None, "no best job: no job returned an objective"
    if len({job.measure for job in scored}) > 1:
        return None, "no best job: the jobs' objectives measure different things (objective.of, objective.metric)"
    of, metric, direction = scored[0].measure
    best = (max if direction == "maximize" else min)(scored, key=lambda job: job.metrics["objective"])
    label = f" ({best.label})" if best.label != best.folder else ""
    return best, f"best job: {best.folder}{label}: {metric} of {of} {best.metrics['objective']:.6g} ({direction}d)"


def write_sweep_summary(sweep_dir: Path) -> tuple[Path, Path, str]:
    """sweep.html and sweep.csv over the job folders there; returns their paths and the best job's line."""
    html_path, csv_path = sweep_dir / "sweep.html", sweep_dir / "sweep.csv"
    # Jobs of a parallel launcher end at once: the last to write must have read every job.json before.
    with (sweep_dir / ".sweep.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        jobs = read_jobs(sweep_dir)
        write_whole(csv_path, csv_text(jobs))
        best, line = best_job(jobs)
        write_whole(html_path, render_html(jobs, best, line, common_overrides([job.overrides for job in jobs]),
                                           sweep_dir))
    return html_path, csv_path, line


def read_jobs(sweep_dir: Path) -> list[Job]:
    """Every job folder (each has its job.json from the job's start), in job order."""
    records = {path.parent: _read_record(path) for path in sweep_dir.rglob(JOB_FILE)}
    folders = sorted(records, key=_job_order)
    common = common_overrides([records[folder]["overrides"] for folder in folders])
    jobs = []
    for folder in folders:
        overrides = records[folder]["overrides"]
        label = ", ".join(o for o in overrides if o not in common) or str(folder.relative_to(sweep_dir))
        metrics, verdict, measure = _job_metrics(folder, records[folder])
        jobs.append(Job(str(folder.relative_to(sweep_dir)), overrides, label, metrics, verdict, measure))
    return jobs


def _read_record(path: Path) -> dict:
    """A job's job.json; one this version did not write (before it held the overrides, or not JSON) is
    listed as unreadable with what to do, so the summary still shows every job folder."""
    try:
        record = json.loads(path.read_text())
    except ValueError:
        record = None
    if (isinstance(record, dict) and isinstance(record.get("overrides"), list)
            and record.get("status") in ("running", "completed", "failed")
            and (record["status"] != "failed" or "error" in record)):
        return record
    return {"overrides": [], "status": "unreadable",
            "error": f"{path} is not a job.json this version writes (an older version's?): run the job again"}


def _job_order(folder: Path) -> tuple:
    # Hydra numbers job folders 0, 1, ... 10: order them as numbers, not as text.
    return tuple(int(part) if part.isdigit() else part for part in folder.parts)


def _job_metrics(folder: Path, record: dict) -> tuple[dict[str, float | None], str, tuple[str, str, str] | None]:
    """The job's measurements, its verdict (the report's bound, or why it has none) and what its objective
    measures."""
    failed = f"{record['status']}: {record['error']}" if record["status"] in ("failed", "unreadable") else None
    if not (folder / "results.json").is_file():
        return dict.fromkeys(METRICS), failed or "no results.json (the job is running, or was killed)", None
    results = json.loads((folder / "results.json").read_text())
    analysis = analyse(results)
    accuracy = results.get("ensemble", {}).get("final_val_accuracy")
    objective = results.get("objective") or {}
    measure = tuple(objective.get(key) for key in ("of", "metric", "direction"))
    returned = record["status"] == "completed"  # a failed job (a member given up) returned nothing to Hydra
    if None in measure or not returned:
        measure = None
    return {
        "objective": objective.get("value") if returned else None,
        "images_per_s": analysis.images_per_s,
        "cpu_s_per_epoch": analysis.cpu_s_per_epoch,
        "mean_stall_pct": analysis.mean_stall_pct,
        "ensemble_accuracy": None if accuracy is None else 100 * accuracy,
        "wall_s": results.get("wall_s"),
    }, failed or analysis.verdict.bound, measure


def common_overrides(override_lists: list[list[str]]) -> list[str]:
    """The overrides every job shares (shown once, not in every job's label)."""
    if not override_lists:
        return []
    return [o for o in override_lists[0] if all(o in others for others in override_lists)]


def csv_text(jobs: list[Job]) -> str:
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(["job", "overrides", *METRICS, "verdict"])
    for job in jobs:
        writer.writerow([job.folder, " ".join(job.overrides),
                         *("" if job.metrics[key] is None else f"{job.metrics[key]:.6g}" for key in METRICS),
                         job.verdict])
    return text.getvalue()


def render_html(jobs: list[Job], best: Job | None, line: str, common: list[str], sweep_dir: Path) -> str:
    labels = [job.label for job in jobs]
    charts = "".join(
        f"<img alt=\"{escape(title)}\" src=\"data:image/png;base64,"
        f"{plots.sweep_bar(labels, [job.metrics[key] for job in jobs], title, unit)}\">"
        for key, (title, unit) in METRICS.items()) if jobs else ""
    head = "".join(f"<th>{escape(h)}</th>" for h in ["job", "overrides", *(t for t, _ in METRICS.values()),
                                                        "verdict"])
    rows = "".join(
        ("<tr class=\"best\">" if job is best else "<tr>")
        + f"<td><a href=\"{escape(job.folder)}/report.html\">{escape(job.folder)}</a> "
        f"(<a href=\"{escape(job.folder)}/{TRACKING}/{TRACKING_CSV}\">metrics</a>)</td>" + "".join(
            f"<td>{escape(cell)}</td>" for cell in [job.label, *(_cell(job.metrics[key]) for key in METRICS),
                                                    job.verdict]) + "</tr>" for job in jobs)
    shared = escape(" ".join(common)) or "(none)"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Sweep summary</title>"
            f"<style>{CSS} .charts {{ display: flex; flex-wrap: wrap; gap: 1em; }} "
            ".charts img { width: 370px; } tr.best td { font-weight: bold; }</style></head><body>\n"
            f"<h1>Sweep summary: {len(jobs)} job(s)</h1><p>{escape(line[0].upper() + line[1:])}.</p>"
            f"<p class=\"note\">Overrides shared by every job: <code>{shared}</code>. Each job's own report is "
            f"report.html in its folder (its link), its members' metrics by epoch {TRACKING}/{TRACKING_CSV} and "
            f"TensorBoard's files (<code>tensorboard --logdir {escape(str(sweep_dir))}</code>); job.json there says "
            "how it ended.</p>"
            f"<div class=\"charts\">{charts}</div>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>\n</body></html>\n")


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.3g}"
