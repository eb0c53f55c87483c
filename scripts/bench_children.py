"""Benchmark of how fast a run's children start (docs/benchmarks.md, Child start-up): k children
started at once, each doing what a trainer does first (import the trainer's module and torch, build a
ResNet-10 and its SGD optimiser, which imports torch._dynamo) and then saying so, timed from the first
start to the last word:

* spawn: each child a fresh interpreter that imports all of it (how children started before);
* fork server: each child forked from multiprocessing's fork server, which imported it once
  (pipeline/runtime/lifetime.py, children_context: how a run starts them). The server's own start-up
  (its imports) is timed apart: a run pays it once, while it prepares.

Rounds alternate between the two, so that both see the same machine.

    python scripts/bench_children.py --children 4 --rounds 3
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time


def child(done) -> None:
    """A trainer's first steps: its module, a model and its optimiser."""
    import torch

    from pipeline.training.models import resnet

    model = resnet(depth=10, width=8, num_classes=4)
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    done.send(os.getpid())


def start_round(context, children: int) -> float:
    """Seconds from the first start to the last child's word."""
    pipes = [context.Pipe(duplex=False) for _ in range(children)]
    started = time.perf_counter()
    processes = [context.Process(target=child, args=(send,)) for _, send in pipes]
    for process in processes:
        process.start()
    for receive, _ in pipes:
        receive.recv()
    took = time.perf_counter() - started
    for process in processes:
        process.join()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from pipeline.runtime.lifetime import children_context

    began = time.perf_counter()
    forked = children_context()
    start_round(forked, 1)  # waits for the server's imports
    server_s = time.perf_counter() - began
    spawned = mp.get_context("spawn")
    times = {"spawn": [], "fork server": []}
    for _ in range(args.rounds):
        times["spawn"].append(start_round(spawned, args.children))
        times["fork server"].append(start_round(forked, args.children))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.children} children at "
          f"once, {args.rounds} rounds; fork server's own start-up {server_s:.2f} s (once per process)")
    base = statistics.median(times["spawn"])
    for mode, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{mode:12s} median {median:6.2f} s  (rounds: {', '.join(f'{s:.2f}' for s in seconds)})  "
              f"x{median / base:.3f} of spawn")


if __name__ == "__main__":
    main()
