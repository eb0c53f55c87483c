"""Benchmark of the delivery topologies (docs/topologies.md, section Benchmark, says how to read it).

Side by side in one run, each a real `pipeline.run.run` (Dask LocalCluster,
hubs, shared-memory rings, gloo between simulated nodes, trainer processes):

* grid: 1, 2, 4, 8 models x single_broadcast, all_shared, multi_broadcast,
  duplicated on 2 simulated nodes (2 Dask workers, one per node), consume-only
  trainers: preprocessing CPU-s per epoch, images/s received per trainer,
  data stall, bytes moved (rings, collectives);
* fan-out (target b): one node, 2 workers, single_broadcast, 1 consumer vs 8;
* one core (target c): one node, one Dask worker with one thread (all the
  preprocessing there is), 8 consume-only models, every topology: epoch time;
* real models (target d): 8 tiny ResNets that train, one node, 2 workers,
  shared topologies vs duplicated: epoch time end to end.

Every run trains `--epochs` epochs; the first is a warm-up (trainer processes
start, import torch and fill the rings while the hubs already produce) and
the rates are taken over the others, from the trainers' step timeline.

    python scripts/bench_topology.py --out bench_results/topology
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

from pipeline.report.measurements import occupancy_stats
from pipeline.scheduler.topology import TOPOLOGIES

# pipeline.run (Dask, torch) is imported where it is used: spawned processes
# (hubs, trainers) re-import this script as __mp_main__ and need none of it.
SHARED = TOPOLOGIES[:3]
SHARING_TARGET = 1.15  # (a) at most: CPU-s per epoch of the 8-model ensemble over one model's
FANOUT_TARGET = 0.90  # (b) at least: each of 8 same-node consumers' rate over a single consumer's
ONE_CORE_TARGET = 5.0  # (c) at least: duplicated epoch time over a shared topology's


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_results/topology"), help="folder for JSON and PNG")
    parser.add_argument("--cache", type=Path, default=Path("data/bench_topology"),
                        help="where the synthetic dataset is generated (once) and kept")
    parser.add_argument("--classes", type=int, default=8, help="synthetic classes")
    parser.add_argument("--per-class", type=int, default=128,
                        help="synthetic images per class (8 x 128 = 16 full batches of 64 per epoch)")
    parser.add_argument("--models", type=int, nargs="+", default=[1, 2, 4, 8], help="ensemble sizes of the grid")
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=TOPOLOGIES)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is a warm-up")
    parser.add_argument("--image-size", type=int, default=64, help="output side of the crop")
    parser.add_argument("--real-epochs", type=int, default=2, help="epochs of the real-model runs (target d)")
    parser.add_argument("--real-topologies", nargs="+", default=["single_broadcast", "duplicated"],
                        choices=TOPOLOGIES, help="topologies of the real-model runs (on one node all_shared "
                        "plans exactly as single_broadcast)")
    parser.add_argument("--html-reports", action="store_true",
                        help="let every run write its HTML report and Dask performance report (slower)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["grid", "fanout", "one_core", "real"],
                        help="parts to leave out")
    return parser.parse_args()


def ensemble_override(count: int) -> str:
    """`count` copies of one tiny ResNet on the one sink, named m0..m<count-1>."""
    models = ", ".join(f"{{name: m{i}, input: main, model: {{_target_: pipeline.training.models.resnet, depth: 10, "
                       f"width: 8}}}}" for i in range(count))
    return f"ensemble.models=[{models}]"


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from pipeline.config import register
    from pipeline.training.members import CONF

    register()  # the `schema` node pipeline/conf/config.yaml names first
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def skip_html_reports() -> None:
    """Each run's HTML report and Dask performance report cost 3-5 s of the
    run's end and measure nothing here: replaced, in this process only, by
    no-ops (results.json is still written)."""
    import types

    import pipeline.run as run_module

    run_module.dask_performance_report = lambda *_: contextlib.nullcontext()
    run_module.write_report = lambda results, output_dir: types.SimpleNamespace(summary="", html="(not written)")


def run_one(name: str, args: argparse.Namespace, root: Path, models: int, topology: str, nodes: int, workers: int,
            consume_only: bool, epochs: int) -> dict:
    """One run of the real pipeline; its figures (or the error it raised)."""
    from pipeline.run import run

    overrides = ["+ensemble=caltech256", ensemble_override(models), f"topology={topology}",
                 "~pipeline.stages.alt", "~pipeline.stages.crop_alt",  # one sink: every model reads `main`
                 f"dataset.root={root}", "dataset.synthetic=never", "dataset.val_per_class=0",
                 f"pipeline.image_size={args.image_size}", f"cluster.workers={workers}", f"cluster.nodes={nodes}",
                 f"trainer.epochs={epochs}", f"trainer.consume_only={str(consume_only).lower()}"]
    cfg = compose(overrides)
    out = args.out / "runs" / name
    log = args.out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"  {name}: {models} model(s), {topology}, {nodes} node(s), {workers} worker(s), "
          f"{'consume-only' if consume_only else 'training'} ...", end=" ", flush=True)
    before, load = os.times(), os.getloadavg()[0]
    started = time.perf_counter()
    try:
        with open(log, "w") as stream, contextlib.redirect_stdout(stream):
            results = run(cfg, out)
    except Exception:  # a failed run is a figure too: it is reported, not hidden
        error = traceback.format_exc()
        log.open("a").write(error)
        print(f"FAILED (see {log})")
        return {"name": name, "models": models, "topology": topology, "nodes": nodes, "workers": workers,
                "consume_only": consume_only, "error": error.strip().splitlines()[-1], "log": str(log)}
    after = os.times()
    record = summarize(results, args.image_size)
    record.update({"name": name, "models": models, "topology": topology, "nodes": nodes, "workers": workers,
                   "consume_only": consume_only, "overrides": overrides, "load_average_before": load,
                   "run_wall_s": time.perf_counter() - started,
                   # user + system CPU of this process and every child it reaped (Dask workers, hubs, trainers)
                   "run_cpu_s": sum(after[:4]) - sum(before[:4])})
    print(f"{record['run_wall_s']:.0f} s: CPU {record['cpu_s_per_epoch']:.2f} s/epoch, "
          f"epoch {record['epoch_s']:.2f} s, {record['rate_per_trainer']['min']:.0f}-"
          f"{record['rate_per_trainer']['max']:.0f} img/s per trainer, stall {record['stall_pct']['mean']:.0f}%")
    return record


def summarize(results: dict, image_size: int) -> dict:
    """Figures of one run. Rates come from the trainers' step spans (timeline):
    epoch e of a trainer ends with its last step of that epoch; the measured
    epochs are 1.. (epoch 0 is the warm-up)."""
    epochs = max(m["epochs"] for m in results["models"])
    train_images = results["dataset"]["train_images"]
    batch = results["config"]["pipeline"]["batch_size"]
    steps = -(-train_images // batch)  # batch messages per training epoch (no validation split here)
    lanes: dict[str, list[tuple[float, float]]] = {}
    for span in results["timeline"]:
        if span["what"] == "step":
            lanes.setdefault(span["lane"], []).append((span["start_s"], span["end_s"]))
    rates, stalls, ends_first, ends_last = [], [], [], []
    for lane, spans in sorted(lanes.items()):
        spans.sort()
        if len(spans) != epochs * steps:
            raise RuntimeError(f"{lane}: {len(spans)} steps recorded, expected {epochs} x {steps}")
        measured = spans[steps:]
        window = measured[-1][1] - spans[steps - 1][1]  # end of epoch 0 to end of the last epoch
        busy = sum(end - start for start, end in measured)
        rates.append(len(measured) * batch / window)
        stalls.append(100 * (window - busy) / window)
        ends_first.append(spans[steps - 1][1])
        ends_last.append(measured[-1][1])
    hubs = [hub for info in results["delivery"]["flotillas"].values() for hub in info["hubs"].values()]
    flotillas = list(results["delivery"]["flotillas"].values())
    item_bytes = image_size * image_size * 3
    return {
        "cpu_s_per_epoch": results["pipeline"]["cpu_s_per_epoch"],
        "stage_cpu_s": {name: s["cpu_s"] / epochs for name, s in results["pipeline"]["stages"].items()},
        # The flotilla's epoch: from the last trainer done with epoch 0 to the last one done with the last epoch.
        "epoch_s": (max(ends_last) - max(ends_first)) / (epochs - 1),
        "rate_per_trainer": {"min": min(rates), "mean": statistics.fmean(rates), "max": max(rates),
                             "each": rates},
        "stall_pct": {"min": min(stalls), "mean": statistics.fmean(stalls), "max": max(stalls)},
        "run_stall_pct": [m["data_stall_pct"] for m in results["models"]],  # whole run, warm-up included
        "ring_bytes_per_epoch": sum(h["ring_bytes"] for h in hubs) / epochs,
        "collective_bytes_per_epoch": sum(h["sent_bytes"] for h in hubs) / epochs,
        "epoch_payload_bytes": train_images * (item_bytes + 8),  # one epoch's images (uint8) and labels (int64)
        "hubs": [{k: h[k] for k in ("node", "stream", "part", "ring_bytes", "sent_bytes", "received_bytes",
                                    "exchange_s", "publish_wait_s")}
                 | {"occupancy": occupancy_stats(h["occupancy"])} for h in hubs],
        "streams": [s for info in flotillas for s in info["streams"]],
        "epochs": epochs, "train_images": train_images,
        "worker_busy_pct": results["cluster"]["worker_busy_pct"], "wall_s": results["wall_s"],
    }


def machine_info() -> dict:
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())
    versions = {package: importlib.metadata.version(package) for package in
                ("dask", "distributed", "torch", "simplejpeg", "numpy")}
    return {"cores": len(os.sched_getaffinity(0)), "cpu_model": cpu_model, "platform": platform.platform(),
            "python": platform.python_version(), "versions": versions}


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def ok_runs(runs: list[dict]) -> dict[tuple[int, str], dict]:
    return {(r["models"], r["topology"]): r for r in runs if "error" not in r}


def evaluate(parts: dict, largest: int) -> dict:
    """PASS/FAIL per target, from the runs of this invocation."""
    targets = {}
    grid = ok_runs(parts.get("grid", []))
    ones = [r["cpu_s_per_epoch"] for (n, _), r in grid.items() if n == 1]
    if ones and largest > 1:
        one = statistics.median(ones)
        ratios = {t: grid[largest, t]["cpu_s_per_epoch"] / one for t in TOPOLOGIES if (largest, t) in grid}
        targets["a"] = {"what": f"preprocessing CPU-s per epoch, {largest} models / one model (median of the "
                                f"1-model runs, {one:.2f} s), at most {SHARING_TARGET}x for shared topologies "
                                "(duplicated ~N x expected)",
                        "one_model_cpu_s": one, "ratios": ratios,
                        "verdicts": {t: verdict(r <= SHARING_TARGET) if t in SHARED else "reference"
                                     for t, r in ratios.items()}}
    fan = ok_runs(parts.get("fanout", []))
    if (1, "single_broadcast") in fan and (largest, "single_broadcast") in fan:
        single = fan[1, "single_broadcast"]["rate_per_trainer"]["min"]
        many = fan[largest, "single_broadcast"]["rate_per_trainer"]
        targets["b"] = {"what": f"each of {largest} same-node consume-only trainers' received rate over one "
                                f"trainer's, at least {FANOUT_TARGET:.0%} (worst trainer)",
                        "single_img_s": single, "worst_img_s": many["min"], "mean_img_s": many["mean"],
                        "ratio_worst": many["min"] / single, "ratio_mean": many["mean"] / single,
                        "verdict": verdict(many["min"] / single >= FANOUT_TARGET)}
    core = ok_runs(parts.get("one_core", []))
    if (largest, "duplicated") in core:
        dup = core[largest, "duplicated"]["epoch_s"]
        speedups = {t: dup / core[largest, t]["epoch_s"] for t in SHARED if (largest, t) in core}
        targets["c"] = {"what": f"one Dask worker thread, {largest} consume-only models: duplicated epoch time "
                                f"over each shared topology's, at least {ONE_CORE_TARGET}x",
                        "duplicated_epoch_s": dup, "speedups": speedups,
                        "verdicts": {t: verdict(s >= ONE_CORE_TARGET) for t, s in speedups.items()}}
    real = ok_runs(parts.get("real", []))
    if (largest, "duplicated") in real:
        dup = real[largest, "duplicated"]["epoch_s"]
        targets["d"] = {"what": f"{largest} tiny ResNets training: duplicated epoch time over each shared "
                                "topology's (end to end; no target, reported)",
                        "duplicated_epoch_s": dup,
                        "speedups": {t: dup / real[largest, t]["epoch_s"] for t in SHARED if (largest, t) in real}}
    return targets


def print_tables(parts: dict, targets: dict) -> None:
    for part, runs in parts.items():
        print(f"\n{part}")
        print(f"{'models':>6} {'topology':<17} {'CPU s/ep':>8} {'epoch s':>8} {'img/s/trainer min-mean':>23} "
              f"{'stall %':>7} {'ring MB/ep':>10} {'coll MB/ep':>10}")
        for r in runs:
            if "error" in r:
                print(f"{r['models']:>6} {r['topology']:<17} FAILED: {r['error']}")
                continue
            rate = r["rate_per_trainer"]
            print(f"{r['models']:>6} {r['topology']:<17} {r['cpu_s_per_epoch']:>8.2f} {r['epoch_s']:>8.2f} "
                  f"{rate['min']:>11.0f} - {rate['mean']:<9.0f} {r['stall_pct']['mean']:>7.1f} "
                  f"{r['ring_bytes_per_epoch'] / 1e6:>10.1f} {r['collective_bytes_per_epoch'] / 1e6:>10.1f}")
    print("\ntargets")
    if "a" in targets:
        t = targets["a"]
        for topology, ratio in t["ratios"].items():
            print(f"  (a) CPU-s/epoch {topology}: {ratio:.2f}x one model -> {t['verdicts'][topology]}")
    if "b" in targets:
        t = targets["b"]
        print(f"  (b) worst of 8 consumers {t['worst_img_s']:.0f} img/s vs one consumer {t['single_img_s']:.0f}: "
              f"{t['ratio_worst']:.0%} (mean {t['ratio_mean']:.0%}) -> {t['verdict']}")
    if "c" in targets:
        t = targets["c"]
        for topology, speedup in t["speedups"].items():
            print(f"  (c) one core, epoch duplicated / {topology}: {speedup:.2f}x -> {t['verdicts'][topology]}")
    if "d" in targets:
        for topology, speedup in targets["d"]["speedups"].items():
            print(f"  (d) real models, epoch duplicated / {topology}: {speedup:.2f}x")


def plot(parts: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in parts.get("grid", []) if "error" not in r]
    if not grid:
        return
    fig, (cpu, rate) = plt.subplots(1, 2, figsize=(11, 4.2))
    for topology in TOPOLOGIES:
        runs = sorted((r for r in grid if r["topology"] == topology), key=lambda r: r["models"])
        if not runs:
            continue
        models = [r["models"] for r in runs]
        cpu.plot(models, [r["cpu_s_per_epoch"] for r in runs], marker="o", label=topology)
        rate.plot(models, [r["rate_per_trainer"]["mean"] for r in runs], marker="o", label=topology)
    for axis, title in ((cpu, "preprocessing CPU-s per epoch"), (rate, "images/s received per trainer (mean)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        axis.set_xlabel("models")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    cpu.legend()
    fig.suptitle("2 simulated nodes, 2 Dask workers, consume-only trainers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(args: argparse.Namespace, root: Path, parts: dict, largest: int, load_before, started: float,
         finished: bool) -> dict:
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "finished": finished,
              "machine": machine_info(),
              "dataset": {"root": str(root), "classes": args.classes, "per_class": args.per_class,
                          "image_size": args.image_size, "batch_size": 64},
              "epochs": args.epochs, "real_epochs": args.real_epochs, "parts": parts,
              "targets": evaluate(parts, largest), "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "wall_s": time.perf_counter() - started}
    (args.out / "topology.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def main() -> None:
    args = parse_args()
    from pipeline.data.synthetic import generate_imagefolder

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    root = args.cache.resolve()
    generate_imagefolder(root, args.classes, args.per_class, seed=0)
    if not args.html_reports:
        skip_html_reports()
    largest = max(args.models)
    load_before = os.getloadavg()
    print(f"{machine_info()['cores']} cores, load average before: {load_before[0]:.1f}; "
          f"{args.classes * args.per_class} images per epoch, {args.epochs} epochs per run (first: warm-up)")
    plan = {
        "grid": [(n, t, 2, 2, True, args.epochs) for n in args.models for t in args.topologies],
        "fanout": [(n, "single_broadcast", 1, 2, True, args.epochs) for n in sorted({1, largest})],
        "one_core": [(largest, t, 1, 1, True, args.epochs) for t in args.topologies],
        "real": [(largest, t, 1, 2, False, args.real_epochs) for t in args.real_topologies],
    }
    parts: dict[str, list[dict]] = {}
    for part, runs in plan.items():
        if part in args.skip:
            continue
        print(part)
        parts[part] = []
        for n, t, nodes, workers, consume, epochs in runs:
            record = run_one(f"{part}-{n}-{t}", args, root, n, t, nodes, workers, consume, epochs)
            if "error" in record:  # once more; the failure stays in the JSON (earlier_failures)
                again = run_one(f"{part}-{n}-{t}-retry", args, root, n, t, nodes, workers, consume, epochs)
                again["earlier_failures"] = [record]
                record = again
            parts[part].append(record)
            save(args, root, parts, largest, load_before, started, finished=False)  # a killed run keeps its figures
    report = save(args, root, parts, largest, load_before, started, finished=True)
    print_tables(parts, report["targets"])
    plot(parts, args.out / "topology.png")
    print(f"\n{args.out / 'topology.json'}, {args.out / 'topology.png'}; {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
