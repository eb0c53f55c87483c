"""Measurements that results.json may hold beyond the basic ones: the report
shows each when the run recorded it and lists the ones it did not. Nothing
here is estimated: absent data stays absent."""
from __future__ import annotations

import numpy as np

# key in results.json -> what it gives the report (docs/report.md has types and units)
OPTIONAL = {
    "cluster.threads": "worker thread count for remote clusters",
    "cluster.worker_busy_pct": "measured Dask worker utilisation",
    "pipeline.stages.<stage>.latency_ms": "stage latency p50/p95 per batch",
    "pipeline.stages.<stage>.bytes_in/bytes_out": "bytes in/out per stage",
    "pipeline.occupancy": "prefetch and ring occupancy over time",
    "delivery.hubs": "bytes moved and delivery latency per hub",
    "timeline": "batch tasks per worker and steps per trainer over time",
    "differential": "stall split into fetch, preprocessing and transport",
    "models.<i>.flotillas": "the flotillas each model trained in (all in one flotilla otherwise)",
}


def recorded(results: dict) -> list[str]:
    """The OPTIONAL keys present in results."""
    stages = results.get("pipeline", {}).get("stages", {}).values()
    present = {
        "cluster.threads": "threads" in results.get("cluster", {}),
        "cluster.worker_busy_pct": bool(results.get("cluster", {}).get("worker_busy_pct")),
        "pipeline.stages.<stage>.latency_ms": any("latency_ms" in s for s in stages),
        "pipeline.stages.<stage>.bytes_in/bytes_out": any("bytes_in" in s for s in stages),
        "pipeline.occupancy": bool(results.get("pipeline", {}).get("occupancy")),
        "delivery.hubs": bool(results.get("delivery", {}).get("hubs")),
        "timeline": bool(results.get("timeline")),
        "differential": bool(results.get("differential")),
        "models.<i>.flotillas": any(m.get("flotillas") for m in results.get("models", [])),
    }
    return [key for key in OPTIONAL if present[key]]


def occupancy_stats(queue: dict) -> dict:
    """Time-weighted statistics of one queue's samples (each value holds until the next sample)."""
    times = np.asarray(queue["t_s"], dtype=float)
    filled = np.asarray(queue["filled"], dtype=float)[:-1]
    held = np.diff(times)
    total = held.sum()
    if total <= 0:
        return {"capacity": queue["capacity"], "mean_pct": None, "p95_pct": None, "full_pct": None,
                "empty_pct": None}
    order = np.argsort(filled)
    cumulative = np.cumsum(held[order]) / total
    p95 = filled[order][np.searchsorted(cumulative, 0.95)]
    to_pct = 100 / queue["capacity"]
    return {"capacity": queue["capacity"],
            "mean_pct": float((filled * held).sum() / total * to_pct),
            "p95_pct": float(p95 * to_pct),
            "full_pct": float(100 * held[filled >= queue["capacity"]].sum() / total),
            "empty_pct": float(100 * held[filled == 0].sum() / total)}


def stall_split(rates: dict, compute_images_per_s: float | None) -> dict:
    """DS-Analyzer's differential split of one model's time per image when reading files:
    fetch = files - cached, preprocessing = cached - synthetic, transport = synthetic - compute.
    The compute rate is the one measured with the passes (`compute_images_per_s`, mode=profile) if
    there, else `compute_images_per_s` (the model's rate in the run).
    Differences of measured times; noise can make one slightly negative, and it is shown so."""
    compute = rates.get("compute_images_per_s", compute_images_per_s)
    per_image = {name: 1000 / rates[f"{name}_images_per_s"] for name in ("files", "cached", "synthetic")}
    split = {"fetch_ms": per_image["files"] - per_image["cached"],
             "preprocessing_ms": per_image["cached"] - per_image["synthetic"],
             "transport_ms": per_image["synthetic"] - 1000 / compute if compute else None}
    shares = {key.replace("_ms", "_pct"): None if value is None else 100 * value / per_image["files"]
              for key, value in split.items()}
    measured = {f"{name}_images_per_s": rates[f"{name}_images_per_s"] for name in ("synthetic", "cached", "files")}
    return {**measured, "compute_images_per_s": compute, "files_ms_per_image": per_image["files"], **split,
            **shares}


def trace_events(timeline: list[dict]) -> dict:
    """Chrome / Perfetto trace-event JSON: one complete ("X") event per span, one thread per lane."""
    lanes = {lane: index for index, lane in enumerate(sorted({e["lane"] for e in timeline}))}
    events = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
              for lane, tid in lanes.items()]
    for e in timeline:
        args = {key: e[key] for key in ("split", "epoch", "batch") if key in e}
        events.append({"name": e["what"], "ph": "X", "pid": 1, "tid": lanes[e["lane"]],
                       "ts": 1e6 * e["start_s"], "dur": 1e6 * (e["end_s"] - e["start_s"]), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
