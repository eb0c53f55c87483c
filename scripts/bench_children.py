"""Benchmark of how fast a run's children start, and train once started (docs/benchmarks.md, Child
start-up): k children started at once, each doing what a trainer does first (import the trainer's
module and torch, build a ResNet-10 and its SGD optimiser, which imports torch._dynamo) and then saying
so, timed from the first start to the last word; then, all k ready, each takes --steps SGD steps on a
batch of 64 images of 64 px with 1 thread, all at once, timed in each child:

* spawn: each child a fresh interpreter that imports all of it (how children started before);
* fork server: each child forked from multiprocessing's fork server, which imported it once
  (pipeline/runtime/lifetime.py, children_context: how a run starts them). The server's own start-up
  (its imports) is timed apart: a run pays it once, while it prepares.

Rounds alternate between the two, so that both see the same machine.

    python scripts/bench_children.py --children 4 --rounds 4
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time


def child(done, go, steps: int) -> None:
    """A trainer's first steps (its module, a model and its optimiser), then `steps` training steps once
    `go` is set; sends None when ready, then the steps' seconds."""
    import torch

    from pipeline.training.models import resnet

    torch.set_num_threads(1)
    model = resnet(depth=10, width=16, num_classes=256, image_size=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    done.send(None)
    images, labels = torch.randn(64, 3, 64, 64), torch.randint(0, 256, (64,))
    go.wait()
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
    done.send(time.perf_counter() - started)


def run_round(context, children: int, steps: int) -> tuple[float, float]:
    """(seconds from the first start to the last child's word, the children's mean seconds of steps)."""
    pipes, go = [context.Pipe(duplex=False) for _ in range(children)], context.Event()
    started = time.perf_counter()
    processes = [context.Process(target=child, args=(send, go, steps)) for _, send in pipes]
    for process in processes:
        process.start()
    for receive, _ in pipes:
        receive.recv()
    start_s = time.perf_counter() - started
    go.set()
    step_s = statistics.mean(receive.recv() for receive, _ in pipes)
    for process in processes:
        process.join()
    return start_s, step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    from pipeline.runtime.lifetime import children_context

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
