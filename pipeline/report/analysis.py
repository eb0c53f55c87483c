"""The numbers behind a bottleneck report: per-stage and per-model tables, the
verdict and the actions with their predicted effect, computed from the dict a
run writes to results.json. Pure arithmetic: no files, no plots.

docs/report.md explains every formula used here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

STALL_THRESHOLD_PCT = 10.0  # the pace-setting trainer waits longer than this: the input side limits the run
BUSY_THRESHOLD_PCT = 70.0  # worker threads busier than this: the stages themselves limit the input

# What each built-in stage's user can change when that stage limits the input.
STAGE_KNOBS = {
    "stages.read.ImageFolder": "faster storage, or a local copy of dataset.root",
    "stages.decode.Decode": "pipeline.cache_gb large enough for the decoded dataset, so that epochs after the "
                            "first decode nothing; the simplejpeg backend, if another is in use; or a smaller "
                            "pipeline.image_size, which simplejpeg decodes at a reduced DCT scale",
    "stages.augment.RandomResizedCropFlip": "a smaller crop size",
}


@dataclass
class StageRow:
    name: str
    target: str | None
    items: int
    cpu_s: float
    wall_s: float
    cpu_share_pct: float | None  # share of all batch-task CPU time
    time_share_pct: float | None  # share of all batch-task wall time
    items_per_s_per_core: float | None  # items / CPU-second
    cpu_over_wall_pct: float | None  # low: the stage waits (I/O, GIL, a busy machine)
    busy_pct: float | None  # share of the worker threads' time this stage occupies
    latency_ms: dict | None  # optional in results.json: {"p50": ms, "p95": ms} per batch
    bytes_in: int | None  # optional in results.json
    bytes_out: int | None  # optional in results.json


@dataclass
class ModelRow:
    name: str
    input: str | None
    slots: int
    flotilla: int
    images_per_s: float | None  # compute rate: images / time in training steps
    data_stall_pct: float | None  # time waiting for the next batch over (wait + step) time
    vs_slowest: float | None  # images_per_s / the flotilla's slowest model's
    vs_fastest: float | None  # images_per_s / the flotilla's fastest model's
    val_accuracy: list[float]
    sets_pace: bool  # the slowest of its flotilla: its rate is the flotilla's
    group: str | None = None  # the slot group it trained in, and how: alone, packed, fused, fused+packed
    group_mode: str | None = None


@dataclass
class Workers:
    threads: int | None  # Dask worker threads that ran batch tasks
    busy_pct: float | None  # their time spent in batch tasks during training
    busy_source: str | None  # "measured" (results.json cluster.worker_busy_pct) or "derived" (see docs)
    task_ms_per_image: float | None  # batch-task wall time per source image, all stages
    task_cpu_ms_per_image: float | None
    capacity_images_per_s: float | None  # input rate with every worker thread busy all the time


@dataclass
class Action:
    change: str  # the override or change to make
    text: str  # why, and what it predicts
    predicted_factor: float | None  # predicted rate / measured rate (an upper bound where text says "up to")
    predicted_images_per_s: float | None
    override: str | None = None  # the Hydra override that applies it; None when it is not one config key


@dataclass
class Verdict:
    bound: str  # "input", "transport", "compute", "input-or-transport" or "unknown"
    stage: str | None  # the limiting stage when input-bound
    model: str | None  # the pace-setting model the stall was read from
    stall_pct: float | None  # that model's data stall
    line: str


@dataclass
class Analysis:
    images_per_s: float | None  # pipeline: training images delivered per second of the training splits
    cpu_s_per_epoch: float | None
    stages: list[StageRow]
    models: list[ModelRow]
    mean_stall_pct: float | None
    workers: Workers
    verdict: Verdict
    actions: list[Action] = field(default_factory=list)


def analyse(results: dict) -> Analysis:
    pipeline = results.get("pipeline", {})
    rate = pipeline.get("images_per_s")
    workers = _workers(results, rate)
    stages = _stage_rows(results, workers)
    models = _model_rows(results.get("models", []))
    stalls = [m.data_stall_pct for m in models if m.data_stall_pct is not None]
    verdict, actions = _verdict_and_actions(results, rate, stages, models, workers)
    # an action capped at or below today's rate (the pace-setter computes no faster: the input rate adds up
    # several flotillas', or a profile pass's runs uncapped) promises nothing
    actions = [a for a in actions if a.predicted_factor is None or a.predicted_factor > 1]
    return Analysis(rate, pipeline.get("cpu_s_per_epoch"), stages, models,
                    sum(stalls) / len(stalls) if stalls else None, workers, verdict, actions)


def amdahl_factor(parallel_fraction: float, times_more: float) -> float:
    """Speed-up when the part `parallel_fraction` of the time gets `times_more` resources."""
    p = min(max(parallel_fraction, 0.0), 1.0)
    return 1 / ((1 - p) + p / times_more)


def _source_images(stages: dict) -> int:
    # Every stage sees every image of its batch; the source's count is the largest (later ones skip bad files).
    return max((s["items"] for s in stages.values()), default=0)


def _worker_threads(results: dict) -> int | None:
    cluster = results.get("cluster", {})
    if "threads" in cluster:
        return cluster["threads"]
    per_worker = results.get("config", {}).get("cluster", {}).get("threads_per_worker", 1)
    return cluster["workers"] * per_worker if isinstance(cluster.get("workers"), int) else None


def _workers(results: dict, rate: float | None) -> Workers:
    stages = results.get("pipeline", {}).get("stages", {})
    images = _source_images(stages)
    threads = _worker_threads(results)
    task_s = sum(s["wall_s"] for s in stages.values()) / images if images else None
    task_cpu_s = sum(s["cpu_s"] for s in stages.values()) / images if images else None
    measured = results.get("cluster", {}).get("worker_busy_pct")
    if measured:
        busy, source = sum(measured.values()) / len(measured), "measured"
    elif rate and task_s and threads:
        # Little's law: thread-seconds of tasks per image times images per second, over the threads.
        busy, source = 100 * rate * task_s / threads, "derived"
    else:
        busy, source = None, None
    capacity = threads / task_s if threads and task_s else None
    return Workers(threads, busy, source, _ms(task_s), _ms(task_cpu_s), capacity)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _stage_rows(results: dict, workers: Workers) -> list[StageRow]:
    stages = results.get("pipeline", {}).get("stages", {})
    targets = {name: entry.get("_target_") for name, entry in
               results.get("config", {}).get("pipeline", {}).get("stages", {}).items()}
    cpu_total = sum(s["cpu_s"] for s in stages.values())
    wall_total = sum(s["wall_s"] for s in stages.values())
    rows = []
    for name, s in stages.items():
        time_share = 100 * s["wall_s"] / wall_total if wall_total else None
        rows.append(StageRow(
            name=name, target=targets.get(name), items=s["items"], cpu_s=s["cpu_s"], wall_s=s["wall_s"],
            cpu_share_pct=100 * s["cpu_s"] / cpu_total if cpu_total else None,
            time_share_pct=time_share,
            # Below a millisecond of CPU the rate is noise (sinks that only pass a pointer on).
            items_per_s_per_core=s["items"] / s["cpu_s"] if s["cpu_s"] > 1e-3 else None,
            cpu_over_wall_pct=100 * s["cpu_s"] / s["wall_s"] if s["wall_s"] > 1e-3 else None,
            busy_pct=workers.busy_pct * time_share / 100 if workers.busy_pct is not None and time_share is not None
            else None,
            latency_ms=s.get("latency_ms"), bytes_in=s.get("bytes_in"), bytes_out=s.get("bytes_out")))
    return rows


def _model_rows(models: list[dict]) -> list[ModelRow]:
    rows = []
    for flotilla in sorted({_flotilla_of(m) for m in models}):
        members = [m for m in models if _flotilla_of(m) == flotilla]
        rates = [m["images_per_s"] for m in members if m["images_per_s"]]
        slowest, fastest = (min(rates), max(rates)) if rates else (None, None)
        for m in members:
            rate = m["images_per_s"]
            rows.append(ModelRow(
                name=m["name"], input=m.get("input"), slots=m.get("slots", 1), flotilla=flotilla,
                images_per_s=rate, data_stall_pct=m.get("data_stall_pct"),
                vs_slowest=rate / slowest if rate and slowest else None,
                vs_fastest=rate / fastest if rate and fastest else None,
                val_accuracy=list(m.get("val_accuracy", [])),
                sets_pace=bool(rate) and rate == slowest, group=m.get("group"), group_mode=m.get("group_mode")))
    return rows


def _flotilla_of(model: dict) -> int:
    """The flotilla a model trained in last (its "flotillas" stints); one flotilla when not recorded."""
    stints = model.get("flotillas")
    return stints[-1]["flotilla"] if stints else 0


def _verdict_and_actions(results: dict, rate: float | None, stages: list[StageRow], models: list[ModelRow],
                         workers: Workers) -> tuple[Verdict, list[Action]]:
    pace_setters = [m for m in models if m.sets_pace and m.data_stall_pct is not None]
    if not pace_setters:
        return Verdict("unknown", None, None, None, "UNKNOWN: no trainer reported a training rate and stall"), []
    # Faster members of a flotilla also wait, but for the slowest one (back-pressure of the shared stream);
    # only the pace-setter's wait says whether the input holds the flotilla back.
    limiter = max(pace_setters, key=lambda m: m.data_stall_pct)
    stall = limiter.data_stall_pct
    if stall <= STALL_THRESHOLD_PCT:
        return _compute_bound(results, limiter, models, workers)
    if workers.busy_pct is None:
        line = (f"INPUT- OR TRANSPORT-BOUND: {limiter.name} waits for data {stall:.0f}% of its time; the worker "
                "threads' busy time is unknown (remote cluster: record cluster.threads)")
        return Verdict("input-or-transport", None, limiter.name, stall, line), []
    if workers.busy_pct >= BUSY_THRESHOLD_PCT:
        return _input_bound(results, rate, limiter, stages, workers)
    return _transport_bound(results, rate, limiter, workers)


def _compute_bound(results: dict, limiter: ModelRow, models: list[ModelRow],
                   workers: Workers) -> tuple[Verdict, list[Action]]:
    peers = sorted(m.images_per_s for m in models if m.flotilla == limiter.flotilla and m.images_per_s)
    line = (f"COMPUTE-BOUND: {limiter.name}, the slowest of {len(peers)} model(s) in its flotilla "
            f"({limiter.images_per_s:.1f} img/s), sets the pace and waits for data only "
            f"{limiter.data_stall_pct:.1f}% of its time")
    verdict = Verdict("compute", None, limiter.name, limiter.data_stall_pct, line)
    if limiter.group_mode not in (None, "alone"):  # it shares a slot: more slots split its group, no DDP
        group = results.get("groups", {}).get(limiter.group, {})
        devices = results.get("devices", {})
        if devices.get("kind") == "cuda":  # its slots are every GPU already: more processes on each
            per_device = results.get("sub_slots", {}).get("chosen") or \
                results.get("config", {}).get("trainer", {}).get("slots_per_device", 1)
            change, more = f"trainer.slots_per_device={per_device + 1}", "more trainer processes on each GPU"
        else:
            change, more = f"trainer.slots={devices.get('slots', 1) + 1}", "more slots"
        text = (f"{change}: {limiter.name} trains in {limiter.group} ({len(group.get('members', []))} models "
                f"{limiter.group_mode} on one slot), which sets the pace; {more} put fewer models on each "
                "(a group's step takes about the sum of its members' steps)")
        return verdict, [Action(change, text, None, None, change)]
    # Twice the slots, at best twice the rate (linear DDP scaling); the next slowest member and the
    # workers' capacity then cap the flotilla.
    slots = 2 * limiter.slots
    caps = [(2 * limiter.images_per_s, f"linear scaling on {slots} slots")]
    if len(peers) > 1:
        caps.append((peers[1], "the next slowest model"))
    if workers.capacity_images_per_s:
        caps.append((workers.capacity_images_per_s, "the workers' capacity"))
    predicted, limit = min(caps)
    factor = predicted / limiter.images_per_s
    key = _slots_key(results, limiter.name)
    change = f"{key or f'slots of model {limiter.name}'}={slots}"
    # a grid's members share their declaration's key: each of them takes the slots
    alike = [m.name for m in models if key and _slots_key(results, m.name) == key]
    each = f" (each of the {len(alike)} members its declaration makes: {', '.join(alike)})" if len(alike) > 1 else ""
    text = (f"{change}: {limiter.name} trains data-parallel on {slots} slots{each} -> flotilla about {factor:.1f}x "
            f"({predicted:.1f} img/s, capped by {limit}); needs {max(len(alike), 1) * (slots - limiter.slots)} "
            "more free slot(s)")
    return verdict, [Action(change, text, factor, predicted, change if key else None)]


def _slots_key(results: dict, model: str) -> str | None:
    """The config key of `model`'s slots: its declaration's, the longest name it is or extends (a grid's
    members are named <declared name>_<key><value>...)."""
    declared = [(len(entry.get("name", "")), index) for index, entry in
                enumerate(results.get("config", {}).get("ensemble", {}).get("models", []))
                if model == entry.get("name") or model.startswith(f"{entry.get('name')}_")]
    return f"ensemble.models.{max(declared)[1]}.slots" if declared else None


def _input_bound(results: dict, rate: float, limiter: ModelRow, stages: list[StageRow],
                 workers: Workers) -> tuple[Verdict, list[Action]]:
    top = max(stages, key=lambda s: s.time_share_pct or 0)
    busy = workers.busy_pct
    line = (f"INPUT-BOUND by stage {top.name}: {limiter.name} waits for data {limiter.data_stall_pct:.0f}% of its "
            f"time; the {workers.threads} worker thread(s) are {busy:.0f}% busy and {top.name} takes "
            f"{top.time_share_pct:.0f}% of batch-task time")
    verdict = Verdict("input", top.name, limiter.name, limiter.data_stall_pct, line)
    ceiling = limiter.images_per_s  # the flotilla cannot go faster than its slowest trainer computes
    actions = [_more_workers(results, rate, busy, workers.threads, ceiling),
               _cheaper_stage(rate, busy, top, ceiling)]
    return verdict, actions


def _more_workers(results: dict, rate: float, busy_pct: float, threads: int, ceiling: float) -> Action:
    factor = amdahl_factor(busy_pct / 100, 2)
    predicted = min(rate * factor, ceiling)
    workers = results.get("cluster", {}).get("workers")
    override = f"cluster.workers={2 * workers}" if isinstance(workers, int) else None  # a remote cluster: not ours
    change = override or f"{2 * threads} worker threads"
    text = (f"{change}: the {threads} worker thread(s) are {busy_pct:.0f}% busy; twice as many -> about "
            f"{predicted / rate:.1f}x input rate ({predicted:.0f} img/s{_capped(rate * factor, ceiling)}), "
            "if as many cores are free")
    return Action(change, text, predicted / rate, predicted, override)


def _cheaper_stage(rate: float, busy_pct: float, stage: StageRow, ceiling: float) -> Action:
    # The stage's part of the time per image is busy x share; halving it is Amdahl with 2x on that part.
    factor = amdahl_factor(busy_pct / 100 * stage.time_share_pct / 100, 2)
    predicted = min(rate * factor, ceiling)
    knob = STAGE_KNOBS.get(stage.target or "", "a cheaper configuration of the stage")
    text = (f"{stage.name} takes {stage.time_share_pct:.0f}% of batch-task time "
            f"({stage.cpu_share_pct or 0:.0f}% of its CPU); halving its cost ({knob}) -> about "
            f"{predicted / rate:.2f}x input rate ({predicted:.0f} img/s{_capped(rate * factor, ceiling)})")
    return Action(f"cheaper {stage.name}", text, predicted / rate, predicted)


def _transport_bound(results: dict, rate: float, limiter: ModelRow,
                     workers: Workers) -> tuple[Verdict, list[Action]]:
    line = (f"TRANSPORT-BOUND: {limiter.name} waits for data {limiter.data_stall_pct:.0f}% of its time while the "
            f"worker threads are only {workers.busy_pct:.0f}% busy ({workers.task_ms_per_image / workers.threads:.2f}"
            f" ms of task time per image per thread vs {1000 / rate:.2f} ms per image at the driver)")
    verdict = Verdict("transport", None, limiter.name, limiter.data_stall_pct, line)
    # Workers kept busy could give their capacity, but never more than the slowest trainer computes.
    predicted = min(workers.capacity_images_per_s, limiter.images_per_s)
    limit = ("the slowest trainer's compute rate" if workers.capacity_images_per_s > limiter.images_per_s
             else f"the workers' capacity at {workers.task_ms_per_image:.2f} ms of task time per image")
    ceiling = f"up to {predicted / rate:.1f}x input rate ({predicted:.0f} img/s, {limit})"
    in_flight = results["cluster"]["in_flight"]  # the window the run gave each producer
    depth = results.get("config", {}).get("delivery", {}).get("ring_depth")
    actions = [Action(f"cluster.in_flight={2 * in_flight}",
                      f"cluster.in_flight={2 * in_flight} (now {in_flight}): the workers idle while trainers "
                      f"wait, so more batches ahead keep them busy -> {ceiling}",
                      predicted / rate, predicted, f"cluster.in_flight={2 * in_flight}")]
    if depth:
        actions.append(Action(f"delivery.ring_depth={2 * depth}",
                              f"delivery.ring_depth={2 * depth} (now {depth}): a deeper ring absorbs bursts between "
                              f"producer and trainers -> {ceiling}; queue occupancy shows which of the two "
                              "runs empty", predicted / rate, predicted, f"delivery.ring_depth={2 * depth}"))
    return verdict, actions


def _capped(uncapped: float, ceiling: float) -> str:
    return ", capped by the slowest trainer's compute rate" if uncapped > ceiling else ""
