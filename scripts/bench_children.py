"""Benchmark of how fast a run's children start, and train once started (docs/benchmarks.md, Child
start-up): k children started at once, each doing what a trainer does first (build its `GroupStep`:
a ResNet-10 member with the shipped SGD, cosine schedule and loss; the first optimiser imports
torch._dynamo) and then saying so, timed from the first start to the last word; then, all k ready,
each takes --steps training steps of the trainer's own (`GroupStep.train`, a batch of 64 images of
64 px, 1 thread), all at once, timed in each child:

* spawn: each child a fresh interpreter that imports all of it (how children started before);
* fork server: each child forked from multiprocessing's fork server, which imported it once
  (pipeline/runtime/lifetime.py, children_context: how a run starts them). The server's own start-up
  (its imports) is timed apart: a run pays it once, while it prepares.

Rounds alternate between the two, each going first in turn, so that both see the same machine.

    python scripts/bench_children.py --children 4 --rounds 4
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time

from pipeline.runtime.child import Child
from pipeline.runtime.lifetime import children_context

SIDE, CLASSES = 64, 256  # the children's images and classes


def child(go, steps: int, *, to_parent, from_parent) -> None:
    """Process entry point (runtime.child.Child): a trainer's first steps (its GroupStep), then `steps`
    training steps once `go` is set; sends None when ready, then the steps' seconds."""
    import numpy as np
    import torch

    from pipeline.training.group import GroupSpec, GroupStep
    from pipeline.training.members import with_defaults

    torch.set_num_threads(1)
    member = with_defaults("m", {"_target_": "pipeline.training.models.resnet", "depth": 10, "width": 16})
    step = GroupStep(GroupSpec("m", (member,)), CLASSES, {"main": SIDE}, torch.device("cpu"), max(steps, 1), threads=1)
    random = np.random.default_rng(0)
    images = step.normalise(random.integers(0, 256, (64, SIDE, SIDE, 3), dtype=np.uint8))
    labels = torch.from_numpy(random.integers(0, CLASSES, 64))
    to_parent.send(None)
    go.wait()
    started = time.perf_counter()
    for _ in range(steps):
        step.train({"main": (images, labels)})
    to_parent.send(time.perf_counter() - started)


def run_round(context, count: int, steps: int) -> tuple[float, float]:
    """(seconds from the first start to the last child's word, the children's mean seconds of steps)."""
    go = context.Event()
    started = time.perf_counter()
    processes = [Child(child, (go, steps), f"bench-child-{i}", context) for i in range(count)]
    try:
        for process in processes:
            process.receive()
        start_s = time.perf_counter() - started
        go.set()
        step_s = statistics.mean(process.receive() for process in processes)
    finally:
        for process in processes:
            process.stop(5)  # it exits once it reported; one that does not, or an error here, is killed
    return start_s, step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    began = time.perf_counter()
    forked = children_context()
    run_round(forked, 1, 0)  # waits for the server's imports
    server_s = time.perf_counter() - began
    contexts = {"spawn": mp.get_context("spawn"), "fork server": forked}
    times = {mode: [] for mode in contexts}
    for index in range(args.rounds):  # alternate which goes first
        for mode in (list(contexts) if index % 2 == 0 else list(contexts)[::-1]):
            times[mode].append(run_round(contexts[mode], args.children, args.steps))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.children} children at "
          f"once, {args.rounds} rounds; fork server's own start-up {server_s:.2f} s (once per process)")
    for what, column in (("start", 0), (f"{args.steps} steps", 1)):
        base = statistics.median(t[column] for t in times["spawn"])
        for mode, rounds in times.items():
            seconds = [t[column] for t in rounds]
            median = statistics.median(seconds)
            print(f"{what:9s} {mode:12s} median {median:6.2f} s  (rounds: {', '.join(f'{s:.2f}' for s in seconds)})"
                  f"  x{median / base:.3f} of spawn")


if __name__ == "__main__":
    main()
