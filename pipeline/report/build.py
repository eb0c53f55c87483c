"""Writes a run's bottleneck report: report.json (schema-versioned, see
docs/report.md), report.html (one self-contained file) and, when the run
recorded a timeline, trace.json for chrome://tracing or Perfetto. A Dask
performance report the run left next to them (dask-report.html) is linked."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from html import escape
from pathlib import Path

from pipeline.report import plots
from pipeline.report.analysis import Analysis, analyse
from pipeline.report.measurements import OPTIONAL, occupancy_stats, recorded, stall_split, trace_events
from pipeline.report.summary import no_training_images
from pipeline.runtime.files import write_whole

# 4: run.dataset.split an object, not a sentence; 3: "streams" -> "hubs"; 2: "transport" -> "streams",
# actions name delivery.ring_depth
SCHEMA_VERSION = 4
DASK_REPORT = "dask-report.html"  # Dask's performance report, when the run wrote one into its folder

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
.verdict { padding: 0.8em 1em; border-radius: 6px; font-weight: bold; }
.verdict.input, .verdict.transport, .verdict.input-or-transport { background: #fdecea; border: 1px solid #c0392b; }
.verdict.compute { background: #eafaf1; border: 1px solid #27ae60; }
.verdict.unknown { background: #f4f4f4; border: 1px solid #999; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f4f6f7; }
img { max-width: 100%; display: block; margin: 0.5em 0; }
.note { color: #666; font-size: 0.9em; }
"""


@dataclass
class ReportPaths:
    json: Path
    html: Path
    trace: Path | None  # only when results.json holds a timeline
    summary: str  # a few lines for the terminal


def write_report(results: dict, output_dir: Path) -> ReportPaths:
    analysis = analyse(results)
    output_dir = Path(output_dir)
    json_path, html_path = output_dir / "report.json", output_dir / "report.html"
    dask_report = DASK_REPORT if (output_dir / DASK_REPORT).is_file() else None  # relative: the folder may move
    write_whole(json_path, json.dumps(report_dict(results, analysis, dask_report), indent=2))
    write_whole(html_path, render_html(results, analysis, dask_report))
    trace_path = None
    if results.get("timeline"):
        trace_path = output_dir / "trace.json"
        write_whole(trace_path, json.dumps(trace_events(results["timeline"])))
    return ReportPaths(json_path, html_path, trace_path, terminal_summary(results, analysis, html_path, dask_report))


def report_dict(results: dict, analysis: Analysis, dask_report: str | None = None) -> dict:
    report = {
        "schema_version": SCHEMA_VERSION,
        "verdict": asdict(analysis.verdict),
        "actions": [asdict(a) for a in analysis.actions],
        "pipeline": {"images_per_s": analysis.images_per_s, "cpu_s_per_epoch": analysis.cpu_s_per_epoch,
                     "mean_stall_pct": analysis.mean_stall_pct},
        "workers": asdict(analysis.workers),
        "stages": [asdict(s) for s in analysis.stages],
        "models": [asdict(m) for m in analysis.models],
        "ensemble": {key: results.get("ensemble", {}).get(key) for key in ("val_accuracy", "final_val_accuracy")},
        "bad_files": {"skipped": results.get("skipped", []), "converted": results.get("converted", [])},
        "run": {"mode": results.get("mode", "train"),
                "epochs": max((m.get("epochs", 0) for m in results.get("models", [])), default=None),
                **{key: results.get(key) for key in ("wall_s", "dataset", "devices", "cluster", "interrupted",
                                                     "given_up")}},
        "measurements_missing": [key for key in OPTIONAL if key not in recorded(results)],
        "dask_report": dask_report,
    }
    if results.get("profile_pass"):
        report["profile_pass"] = results["profile_pass"]
    occupancy = results.get("pipeline", {}).get("occupancy")
    if occupancy:
        report["occupancy"] = {name: occupancy_stats(queue) for name, queue in occupancy.items()}
    if results.get("differential"):
        report["differential"] = _stall_splits(results)
    if results.get("delivery", {}).get("hubs"):
        report["hubs"] = results["delivery"]["hubs"]
    return report


def _stall_splits(results: dict) -> dict:
    compute = {m["name"]: m["images_per_s"] for m in results.get("models", [])}
    return {model: stall_split(rates, compute.get(model)) for model, rates in results["differential"].items()}


def terminal_summary(results: dict, analysis: Analysis, html_path: Path, dask_report: str | None = None) -> str:
    workers = analysis.workers
    busy = "-" if workers.busy_pct is None else f"{workers.busy_pct:.0f}% ({workers.busy_source})"
    top = max(analysis.stages, key=lambda s: s.time_share_pct or 0, default=None)
    lines = [f"bottleneck: {analysis.verdict.line}",
             f"  input {_num(analysis.images_per_s, '{:,.1f}')} img/s; worker threads busy {busy}"
             + (f"; {top.name} takes {top.time_share_pct:.0f}% of batch-task time" if top and top.time_share_pct
                else "")]
    lines += [f"  action: {action.text}" for action in analysis.actions]
    splits = _stall_splits(results) if results.get("differential") else {}
    model = analysis.verdict.model if analysis.verdict.model in splits else next(iter(splits), None)
    if model:
        s = splits[model]
        lines.append(f"  stall split of {model} ({s['files_ms_per_image']:.2f} ms per image from files): "
                     + ", ".join(f"{part} {_part(s, part)}" for part in ("fetch", "preprocessing", "transport")))
    lines.append(f"  report: {html_path}" + (f"  Dask: {html_path.with_name(dask_report)}" if dask_report else ""))
    if results.get("interrupted"):
        lines.insert(0, f"INTERRUPTED ({results['interrupted']['cause']}): the figures cover the run until then")
    return "\n".join(lines)


def render_html(results: dict, analysis: Analysis, dask_report: str | None = None) -> str:
    sections = [
        _how_it_ended(results),
        _profile_note(results),
        _verdict_section(analysis),
        _pipeline_section(results, analysis),
        _stages_section(analysis),
        _models_section(results, analysis),
        _optional_sections(results),
        _dask_section(dask_report),
        _bad_files_section(results),
        _missing_section(results),
    ]
    dataset = results.get("dataset", {})
    title = f"Bottleneck report: {dataset.get('name', 'run')}"
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{CSS}</style></head><body>\n<h1>{escape(title)}</h1>\n" + "\n".join(sections)
            + "\n</body></html>\n")


def _how_it_ended(results: dict) -> str:
    """A run that was stopped, or gave a model up, says so first."""
    notes = []
    if results.get("interrupted"):
        stop = results["interrupted"]
        notes.append(f"Interrupted ({stop['cause']}): every model resumes from its last checkpoint; "
                     f"run the same command with {stop['resume']} to continue.")
    if results.get("given_up"):
        notes.append(f"Given up after scheduler.max_failures failures: {', '.join(results['given_up'])} "
                     "(their failures: results.json).")
    return "".join(f"<p class=\"note\"><b>{escape(note)}</b></p>" for note in notes)


def _profile_note(results: dict) -> str:
    profile = results.get("profile_pass")
    if not profile:
        return ""
    return (f"<p class=\"note\">Profile mode (no training): {profile['batches']} batches through the pipeline, "
            "consumed by the driver as fast as it could (input rate, stages, workers); trainer rates and stalls "
            f"from {profile['steps']} training steps per model in this process, fed from files "
            "(docs/report.md, profile mode).</p>")


def _verdict_section(analysis: Analysis) -> str:
    actions = "".join(f"<li>{escape(a.text)}</li>" for a in analysis.actions)
    return (f"<div class=\"verdict {escape(analysis.verdict.bound)}\">{escape(analysis.verdict.line)}</div>"
            + (f"<h2>Actions</h2><ul>{actions}</ul>" if actions else "")
            + "<p class=\"note\">How the verdict and the predictions are computed: docs/report.md.</p>")


def _pipeline_section(results: dict, analysis: Analysis) -> str:
    w = analysis.workers
    rate_label = ("input rate (pipeline pass: images handed to the driver, nobody training)"
                  if results.get("mode") == "profile" else "input rate (training images into the trainers)")
    rows = [
        [rate_label, _num(analysis.images_per_s, "{:,.1f} img/s")],
        ["preprocessing CPU per epoch", _num(analysis.cpu_s_per_epoch, "{:.2f} CPU-s")],
        ["worker threads", _num(w.threads, "{}")],
        [f"worker threads busy ({w.busy_source or 'unknown'})", _num(w.busy_pct, "{:.0f}%")],
        ["batch-task time per image (wall / CPU)",
         f"{_num(w.task_ms_per_image, '{:.2f}')} / {_num(w.task_cpu_ms_per_image, '{:.2f}')} ms"],
        ["workers' capacity (all threads busy)", _num(w.capacity_images_per_s, "{:,.0f} img/s")],
        ["mean data stall over trainers", _num(analysis.mean_stall_pct, "{:.1f}%")],
        ["end-to-end wall time", _num(results.get("wall_s"), "{:.1f} s")],
    ]
    by_epoch = results["pipeline"].get("cpu_s_by_epoch")  # none in profile mode: it runs no epochs
    return ("<h2>Pipeline</h2>" + _table(["", "value"], rows)
            + (_img(plots.epoch_cpu_chart(by_epoch, results["pipeline"]["cpu_s_by_flotilla_epoch"],
                                          results["pipeline"].get("cache_hit_rate_by_epoch")),
                    "preprocessing CPU and cache hits per epoch") if by_epoch else ""))


def _stages_section(analysis: Analysis) -> str:
    headers = ["stage", "items", "CPU s", "wall s", "CPU share", "time share", "items/s per core", "CPU / wall",
               "busy"]
    with_latency = any(s.latency_ms for s in analysis.stages)
    with_bytes = any(s.bytes_in is not None for s in analysis.stages)
    headers += ["latency p50 / p95 ms"] * with_latency + ["MB in / out"] * with_bytes
    rows = []
    for s in analysis.stages:
        row = [s.name, str(s.items), f"{s.cpu_s:.2f}", f"{s.wall_s:.2f}", _num(s.cpu_share_pct, "{:.1f}%"),
               _num(s.time_share_pct, "{:.1f}%"), _num(s.items_per_s_per_core, "{:,.0f}"),
               _num(s.cpu_over_wall_pct, "{:.0f}%"), _num(s.busy_pct, "{:.0f}%")]
        if with_latency:
            row.append(f"{s.latency_ms['p50']:.2f} / {s.latency_ms['p95']:.2f}" if s.latency_ms else "-")
        if with_bytes:
            row.append(f"{_mb(s.bytes_in)} / {_mb(s.bytes_out)}")
        rows.append(row)
    if not rows:
        return "<h2>Stages</h2><p>No stage timings recorded.</p>"
    return ("<h2>Stages</h2>" + _table(headers, rows)
            + "<p class=\"note\">All epochs, training and validation. Busy: the share of the worker threads' "
              "time this stage occupies. CPU / wall below 100%: the stage waits (I/O, GIL, a loaded machine).</p>"
            + _img(plots.stage_chart(analysis.stages), "stage CPU time and rates"))


def _models_section(results: dict, analysis: Analysis) -> str:
    if not analysis.models:
        return "<h2>Trainers</h2><p>No trainer reports.</p>"
    headers = ["model", "input", "group", "slots", "flotilla", "img/s (compute)", "data stall", "vs slowest",
               "vs fastest", "final val acc"]
    rows = [[m.name + (" (sets the pace)" if m.sets_pace else ""), m.input or "-",
             f"{m.group} ({m.group_mode})" if m.group else "-", str(m.slots), str(m.flotilla),
             _num(m.images_per_s, "{:,.1f}"), _num(m.data_stall_pct, "{:.1f}%"), _num(m.vs_slowest, "{:.2f}x"),
             _num(m.vs_fastest, "{:.2f}x"), _num(m.val_accuracy[-1] * 100 if m.val_accuracy else None, "{:.1f}%")]
            for m in analysis.models]
    ensemble = results.get("ensemble", {}).get("val_accuracy", [])
    trained = ensemble or any(m.val_accuracy for m in analysis.models)  # a profile run validates nothing
    return ("<h2>Trainers</h2>" + _table(headers, rows)
            + "<p class=\"note\">Compute rate: images over time in training steps (waits excluded). A flotilla "
              "moves at the pace of its slowest member, so its faster members also wait. The members of a slot "
              "group step together: they share its rate and stall.</p>" + _groups_section(results)
            + _flotillas_section(results)
            + _img(plots.stall_chart(analysis.models), "data stall per trainer")
            + (_img(plots.accuracy_chart(analysis.models, ensemble), "accuracy per epoch") if trained else ""))


def _flotillas_section(results: dict) -> str:
    """Each flotilla's rate as the scheduler planned it (its slowest member's measured rate, capped by the
    preprocessing its slots' cores do at the cost measured then) and as it ran."""
    plans = results.get("scheduler", {}).get("flotillas")
    if not isinstance(plans, dict) or not plans:  # (a list in runs before plans were recorded)
        return ""
    rows = [[flotilla, _num(p["planned_images_per_s"], "{:,.0f}"), _num(p["measured_images_per_s"], "{:,.0f}"),
             _num(1e3 * p["prep_seconds_per_image"] if p["prep_seconds_per_image"] else None, "{:.2f} ms")]
            for flotilla, p in plans.items()]
    cores = results["scheduler"]["cluster"]["cores_per_node"]
    return (f"<h3>Flotillas: planned and measured ({cores} preprocessing cores per node)</h3>"
            + _table(["flotilla", "planned img/s", "measured img/s", "preprocessing per image (then)"], rows)
            + "<p class=\"note\">Measured: the slowest member's training images over its time training, "
              "waits for batches included. On CPU slots the members share the cores with each other and with "
              "the pipeline, which the rate table (each model measured alone) does not see.</p>"
            + (_img(plots.gantt_chart(results["scheduler"]), "slots over time")
               if results["scheduler"].get("gantt") else "")
            + _decisions(results["scheduler"].get("decisions", [])))


def _decisions(log: list[dict]) -> str:
    """The scheduler's decisions as the driver carried them out, each with the event that caused it."""
    if not log:
        return ""
    shown = ("t", "decision", "flotilla", "group", "cause")
    rows = [[f"{d['t']:.1f}", d["decision"], d.get("flotilla", ""), d.get("group", ""),
             ", ".join(f"{k}={v}" for k, v in d.items() if k not in shown), d.get("cause", "")] for d in log]
    return (f"<details><summary>Scheduler decisions ({len(log)})</summary>"
            + _table(["t (s)", "decision", "flotilla", "group", "what", "cause"], rows) + "</details>")


def _groups_section(results: dict) -> str:
    """Each slot group that trained several models: who, how (packed or fused), where; and the processes
    per device trainer.grouping=auto measured (sub-slots)."""
    shared = {name: g for name, g in results.get("groups", {}).items() if len(g["members"]) > 1}
    sub_slots = results.get("sub_slots")
    if not shared and not sub_slots:
        return ""
    measured = results.get("grouping", {})
    rows = [[name, g["mode"], str(len(g["members"])), ", ".join(g["devices"]), _sharing_measured(measured.get(name)),
             ", ".join(g["members"])] for name, g in shared.items()]
    section = "<h3>Slot groups</h3>" + (
        _table(["group", "mode", "models", "devices", "img/s measured (grouping=auto)", "members"], rows)
        if rows else "")
    if sub_slots:
        paces = ", ".join(f"{n}: {pace:,.1f}" for n, pace in sub_slots["images_per_s"].items())
        section += (f"<p>Processes per device, measured side by side (images/s of a device's models): {paces}; "
                    f"chosen: {sub_slots['chosen']} (trainer.grouping=auto).</p>")
    return section


def _sharing_measured(measured: dict | None) -> str:
    """What grouping=auto measured of a group: packed and fused, and on a GPU by CUDA streams."""
    measured = measured or {}
    parts = [f"packed {measured['packed']:,.1f} / fused {measured['fused']:,.1f}"] if "packed" in measured else []
    for way, by_streams in measured.get("cuda_streams", {}).items():
        parts.append(f"{way} on streams " + ", ".join(f"{n}: {rate:,.1f}" for n, rate in by_streams.items()))
    return "; ".join(parts) or "-"


def _optional_sections(results: dict) -> str:
    parts = []
    occupancy = results.get("pipeline", {}).get("occupancy")
    if occupancy:
        rows = [[name, str(s["capacity"]), _num(s["mean_pct"], "{:.0f}%"), _num(s["p95_pct"], "{:.0f}%"),
                 _num(s["full_pct"], "{:.0f}%"), _num(s["empty_pct"], "{:.0f}%")]
                for name, s in ((name, occupancy_stats(q)) for name, q in occupancy.items())]
        parts.append("<h2>Queue occupancy</h2>"
                     + _table(["queue", "capacity", "mean", "p95", "time full", "time empty"], rows)
                     + _img(plots.occupancy_chart(occupancy), "queue occupancy over time"))
    busy = results.get("cluster", {}).get("worker_busy_pct")
    if busy:
        parts.append("<h2>Dask workers</h2>" + _table(["worker", "busy"], [[w, f"{b:.0f}%"] for w, b in busy.items()]))
    hubs = results.get("delivery", {}).get("hubs")
    if hubs:
        rows = [[name, _mb(h.get("bytes")), _latency(h.get("latency_ms"))] for name, h in hubs.items()]
        parts.append("<h2>Delivery</h2>" + _table(["hub", "MB moved", "latency p50 / p95 ms"], rows))
    if results.get("differential"):
        splits = _stall_splits(results)
        rows = [[model, _num(s["compute_images_per_s"], "{:,.1f}"), f"{s['synthetic_images_per_s']:,.1f}",
                 f"{s['cached_images_per_s']:,.1f}", f"{s['files_images_per_s']:,.1f}",
                 f"{s['files_ms_per_image']:.2f}", _part(s, "fetch"), _part(s, "preprocessing"),
                 _part(s, "transport")] for model, s in splits.items()]
        parts.append("<h2>Stall split (differential runs)</h2>"
                     + _table(["model", "compute img/s", "synthetic img/s", "cached img/s", "files img/s",
                               "ms per image from files", "fetch", "preprocessing", "transport"], rows)
                     + "<p class=\"note\">The trainer's rate fed by in-memory synthetic batches, by decoded images "
                       "held in memory and by files. Fetch = files - cached (read and decode), preprocessing = "
                       "cached - synthetic (the stages after decoding), transport = synthetic - compute (the "
                       "hand-off of finished batches); docs/report.md.</p>"
                     + _img(plots.stall_split_chart(splits), "stall split per model"))
    if results.get("timeline"):
        parts.append("<h2>Timeline</h2>" + _img(plots.timeline_chart(results["timeline"]), "timeline")
                     + "<p class=\"note\">The same spans are in trace.json next to this file: open it in "
                       "chrome://tracing or ui.perfetto.dev.</p>")
    return "\n".join(parts)


def _dask_section(dask_report: str | None) -> str:
    if not dask_report:
        return ""
    return (f"<h2>Dask performance report</h2><p><a href=\"{escape(dask_report)}\">{escape(dask_report)}</a>: "
            "Dask's own view of the run (task stream, worker profile, bandwidth), next to this file; it opens "
            "offline (inline mode) but needs JavaScript.</p>")


def _part(split: dict, name: str) -> str:
    ms, pct = split[f"{name}_ms"], split[f"{name}_pct"]
    return "-" if ms is None else f"{ms:.2f} ms ({pct:.0f}%)"


def _latency(latency: dict | None) -> str:
    return "-" if not latency else f"{latency['p50']:.2f} / {latency['p95']:.2f}"


def _bad_files_section(results: dict) -> str:
    skipped, converted = results.get("skipped", []), results.get("converted", [])
    rows = [[s["path"], "skipped", s["reason"]] for s in skipped] + \
           [[c["path"], "converted", c["what"]] for c in converted]
    body = _table(["file", "", "why"], rows) if rows else "<p>None: every file decoded as it was.</p>"
    unusable = results.get("dataset", {}).get("classes_without_training_images")
    if unusable:
        body = f"<p><strong>{escape(no_training_images(unusable))}.</strong></p>{body}"
    return f"<h2>Skipped and converted files ({len(skipped)} skipped, {len(converted)} converted)</h2>{body}"


def _missing_section(results: dict) -> str:
    present = recorded(results)
    missing = [f"<li><code>{escape(key)}</code>: {escape(what)}</li>" for key, what in OPTIONAL.items()
               if key not in present]
    if not missing:
        return ""
    return ("<h2>Not recorded by this run</h2><p class=\"note\">The report shows these when results.json holds "
            f"them (docs/report.md):</p><ul class=\"note\">{''.join(missing)}</ul>")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _img(png_base64: str, alt: str) -> str:
    return f"<img alt=\"{escape(alt)}\" src=\"data:image/png;base64,{png_base64}\">"


def _num(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"
