"""Benchmark of slot groups (docs/benchmarks.md says how to read it): k models of one
architecture, differing only in learning rate, trained on the same batches

The architecture: a built-in family (--arch resnet or densenet, fused by HFTA's
operators), or `--arch mobilenet`, a small MobileNetV2-style net written here,
which the project does not ship (fused by vmap, pipeline/training/stacked.py).

* separate: one process per model, all at once, sharing the machine (on CPU each
  process gets cores / k threads, at least 1; on a GPU they share it);
* packed: one process, the k models stepped in turn (`GroupStep`, array_size 1);
* fused: one process, the k models as one fused array (array_size k; on CPU one
  array per thread, stepped side by side, as the planner makes them);
* fused-vmap: as fused, a built-in family fused by vmap instead of HFTA (its
  members spell out SGD's default dampening=0, which HFTA's check does not take);
* on CUDA, each again with "+graphs": every unit's step captured once as a CUDA
  graph and replayed (trainer.cuda_graphs). Plain "separate" (eager) is the
  yardstick: k users' own training scripts sharing the GPU;
* on CUDA, "packed+streams" and "packed+graphs+streams": packed, its members
  on one CUDA stream each (at most MOST_STREAMS), side by side;
* auto: what `trainer.grouping=auto` picks as the run picks it
  (orchestration/group_plan): packed or fused (choose_sharing: both measured by
  the rate measurement, with graphs on CUDA as trainers step by default; on
  CUDA each way on 1, 2, 4, ... streams), then
  n processes side by side, each with its share of the models (choose_sub_slots:
  sub-slots, measured up to one process per model), then timed like the others;
  the row names the pick.

With --compile each mode is followed by "<mode>+compile", the same with its
members compiled by torch.compile (trainer.compile), side by side in the
same run; the compiling falls in the untimed warm-up steps.

Every mode trains with the trainer's own step (pipeline/training/group.py) on
synthetic uint8 batches already in memory, so it times training, not input.
Reported per mode: images/s per model and in total, the ratio to separate,
peak resident memory (all processes together) and, on CUDA, peak allocated.

    python scripts/bench_groups.py --out bench_results/groups
    python scripts/bench_groups.py --arch mobilenet --depth 6 --width 16 --ks 1 4 8 --image-sizes 64
    python scripts/bench_groups.py --device cuda --arch resnet --depth 18 --width 64 --ks 1 4 8 20 \
        --precision bf16
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.orchestration.devices import most_sub_slots, trainer_threads
from pipeline.orchestration.group_plan import MOST_STREAMS, choose_sharing, choose_sub_slots, fused, measure_sizes
from pipeline.runtime.child import Child
from pipeline.scheduler.slot_groups import Grouping
from pipeline.training.group import GroupSpec, GroupStep, Precision
from pipeline.training.members import with_defaults
from pipeline.training.rates import Measurement

MODES = ("separate", "packed", "fused", "fused-vmap")
GRAPH_MODES = tuple(f"{mode}+graphs" for mode in MODES[:3])
STREAM_MODES = ("packed+streams", "packed+graphs+streams")
AUTO = "auto"


class MobileNet(nn.Module):
    """A small MobileNetV2-style net (inverted residuals: 1x1 expand, 3x3 depthwise, 1x1 project; a residual
    add where the shape allows), a module nobody here wrote: the benchmark's model for fusion by vmap."""

    def __init__(self, num_classes: int, width: int = 16, depth: int = 6, expand: int = 4):
        super().__init__()

        def conv(c_in, c_out, kernel, stride=1, groups=1, act=True):
            layers = [nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, groups=groups, bias=False),
                      nn.BatchNorm2d(c_out)]
            return nn.Sequential(*layers, nn.ReLU6()) if act else nn.Sequential(*layers)

        self.stem = conv(3, width, 3, stride=2)
        blocks, channels = [], width
        for i in range(depth):
            stride, out = (2, channels * 2) if i % 2 else (1, channels)  # every other block halves the side
            hidden = channels * expand
            blocks.append(nn.Sequential(conv(channels, hidden, 1), conv(hidden, hidden, 3, stride, groups=hidden),
                                        conv(hidden, out, 1, act=False)))
            channels = out
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            y = block(x)
            x = x + y if y.shape == x.shape else y
        return self.head(x)


def _train(group: GroupSpec, image_size: int, batch: int, device: str, threads: int, steps: int, warmup: int,
           precision: str, graphs: bool, compile: bool, start, *, to_parent, from_parent) -> None:
    """Process entry point (runtime.child.Child): warmup + steps of `group`; reports seconds of the timed
    steps and peak memory."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    step = GroupStep(group, 10, {"main": image_size}, dev, warmup + steps, precision=Precision(precision),
                     threads=threads, cuda_graphs=graphs, compile=compile)
    warmup += step.steps_before_replay  # the replays are timed, not the capture
    random = np.random.default_rng(0)
    images = random.integers(0, 256, (batch, image_size, image_size, 3), dtype=np.uint8)
    labels = torch.from_numpy(random.integers(0, 10, batch)).to(dev)
    x = step.normalise(images)
    for _ in range(warmup):
        step.train({"main": (x, labels)})
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    start.wait()  # every process of a mode times the same stretch of wall time
    started = time.perf_counter()
    for _ in range(steps):
        step.train({"main": (x, labels)})
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - started
    allocated = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    to_parent.send((seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, allocated))


def measure(mode: str, k: int, args, image_size: int) -> dict:
    name, compile = mode, mode.endswith("+compile")
    mode = mode.removesuffix("+compile")
    streams = mode.endswith("+streams")
    mode = mode.removesuffix("+streams")
    graphs = mode.endswith("+graphs") or (mode == AUTO and args.device != "cpu")  # auto: the trainers' default
    # MobileNet is this script's own: spawned processes import it from their __main__, this script
    where = "__main__" if args.arch == "mobilenet" else "pipeline.training.models"
    model = {"_target_": f"{where}.{args.arch.replace('mobilenet', 'MobileNet')}", "depth": args.depth,
             "width": args.width}
    if args.arch == "densenet":
        model["growth_rate"] = args.growth_rate
    spelled_out = {"dampening": 0.0} if mode == "fused-vmap" else {}
    models = [with_defaults(f"m{i}", model, lr=0.1 / (i + 1), **spelled_out) for i in range(k)]
    pick = None
    if mode.startswith("separate"):
        groups = [GroupSpec(m.name, (m,)) for m in models]
        threads = max(1, args.cores // k)
    else:
        group = GroupSpec("group", tuple(models))
        kind = "cpu" if args.device == "cpu" else "cuda"
        lanes = args.cores if kind == "cpu" else 1  # arrays as the planner makes them (on CPU: one per thread,
        sizes = measure_sizes(models, 10, {"main": image_size}, args.batch, kind)  # side by side)
        if mode.startswith("fused"):
            group = fused(group, sizes, math.inf, lanes)
        if streams:
            group = replace(group, cuda_streams=min(len(group.units()), MOST_STREAMS))
        elif mode == AUTO:
            device = args.device if args.device == "cpu" or ":" in args.device else f"{args.device}:0"
            how = Measurement(num_classes=10, image_sizes={"main": image_size}, batch_size=args.batch,
                              device_kind=device.split(":")[0], devices=[device], steps=args.steps,
                              warmup=args.warmup, threads=args.cores, precision=Precision(args.precision),
                              cuda_graphs=graphs, compile=compile)
            kind = how.device_kind

            def split(n: int) -> tuple[Measurement, float]:
                return replace(how, threads=trainer_threads(kind, args.cores, n)), math.inf

            with tempfile.TemporaryDirectory() as cache:  # measured afresh, as a first run would
                cache = Path(cache) / "rates.json"
                [group], _ = choose_sharing([group], Grouping.auto, sizes, math.inf, lanes, how, cache)
                processes, layout, _ = choose_sub_slots(models, [group], sizes, 1, most_sub_slots(kind, args.cores, 1),
                                                        split, cache)
            pick = " + ".join(sorted({g.mode for g in layout})) + (f" x{processes} sub-slots" if processes > 1 else "")
        groups = layout if mode == AUTO else [group]
        threads = trainer_threads(args.device.split(":")[0], args.cores, len(groups))
    context = mp.get_context("spawn")
    start = context.Barrier(len(groups))
    children = [Child(_train, (g, image_size, args.batch, args.device, threads, args.steps, args.warmup,
                               args.precision, graphs, compile, start), f"bench-{g.name}", context)
                for g in groups]
    try:
        reports = [child.receive(args.timeout) for child in children]
    finally:
        for child in children:
            child.stop(5)  # it exits once it reported; one that does not, or an error here, is killed
    # Each model trains batch x steps images; a separate process's own time counts for its model.
    per_model = [args.batch * args.steps / seconds for (seconds, _, _), g in zip(reports, groups) for _ in g.members]
    return {"mode": name, "k": k, "pick": pick, "image_size": image_size,
            "threads_per_process": threads, "array_size": groups[0].array_size,
            "images_per_s_per_model": float(np.mean(per_model)), "images_per_s_total": float(np.sum(per_model)),
            "peak_rss_bytes": int(sum(rss for _, rss, _ in reports)),
            "peak_allocated_bytes": int(sum(a for _, _, a in reports))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--arch", default="resnet", choices=["resnet", "densenet", "mobilenet"])
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--growth-rate", type=int, default=12)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8, 20])
    parser.add_argument("--image-sizes", type=int, nargs="+", default=[64, 224], help="default and paper sizes")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", default="fp32", choices=[p.value for p in Precision])
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="CPU threads in all")
    parser.add_argument("--modes", nargs="+", choices=MODES + GRAPH_MODES + STREAM_MODES + (AUTO,),
                        help="default: all four and auto, and on CUDA separate, packed and fused with +graphs "
                             "too, and packed on streams")
    parser.add_argument("--compile", action="store_true", help="each mode again with its members compiled")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=Path("bench_results/groups"))
    args = parser.parse_args()
    modes = args.modes or (MODES + GRAPH_MODES + STREAM_MODES if args.device != "cpu" else MODES) + (AUTO,)
    if args.device == "cpu" and set(modes) & set(STREAM_MODES):
        parser.error(f"{', '.join(STREAM_MODES)} need a GPU (--device cuda): CUDA streams")
    if args.arch == "mobilenet":  # its fused is vmap's already, whose steps are not captured as graphs
        modes = [mode for mode in modes if mode not in ("fused-vmap", "fused+graphs")]
    if args.compile:
        modes = [variant for mode in modes for variant in (mode, f"{mode}+compile")]
    rows = []
    print(f"{args.arch}{args.depth} w{args.width}, batch {args.batch}, {args.device}, {args.cores} core(s)")
    print(f"{'px':>4} {'k':>3} {'mode':>24} {'img/s/model':>12} {'img/s total':>12} {'vs separate':>12} "
          f"{'peak RSS GiB':>13} {'RSS vs 1 model':>15}" + (" alloc GiB" if args.device != "cpu" else ""))
    for image_size in args.image_sizes:
        one = None  # one model alone: the memory yardstick
        for k in args.ks:
            baseline = None
            for mode in modes if k > 1 else [m for m in modes if m.startswith("separate")]:
                row = measure(mode, k, args, image_size)
                rows.append(row)
                baseline = baseline or row
                one = one or row
                shown = f"{mode}: {row['pick']}" if row["pick"] else mode
                print(f"{image_size:>4} {k:>3} {shown:>24} {row['images_per_s_per_model']:>12.1f} "
                      f"{row['images_per_s_total']:>12.1f} "
                      f"{row['images_per_s_total'] / baseline['images_per_s_total']:>11.2f}x "
                      f"{row['peak_rss_bytes'] / 2**30:>13.2f} {row['peak_rss_bytes'] / one['peak_rss_bytes']:>14.2f}x"
                      + (f" {row['peak_allocated_bytes'] / 2**30:9.2f}" if args.device != "cpu" else ""), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "groups.json").write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cores": args.cores, "device": args.device},
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
