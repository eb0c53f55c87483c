"""Benchmark of the read stage's cost per batch task against the number of files (docs/benchmarks.md).

The stage as it is (`stages.read.shuffle`: an epoch's permutation computed once per worker and
kept) side by side with the baseline it replaced: the permutation computed again in every task.
The file list is synthetic (N entries, every one the same small file, so reading costs the same at
every N); the tasks are spread over the epoch, the first of them (which computes the permutation)
counted.

    python scripts/bench_shuffle.py --files 30000 300000 1280000
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from stages.base import BatchContext, Split
from stages.read import ImageFolder, shuffle


def per_task_ms(source: ImageFolder, epoch: int, tasks: int, recompute: bool) -> list[float]:
    """Milliseconds of each of `tasks` batch tasks spread over one epoch; with `recompute`, each
    also computes the epoch's permutation, as every task did before."""
    n, batches = source.num_items(Split.TRAIN), source.num_batches(Split.TRAIN)
    shuffle.cache_clear()
    times = []
    for index in range(0, batches, max(batches // tasks, 1))[:tasks]:
        started = time.perf_counter()
        if recompute:
            shuffle.__wrapped__(n, 0, 0, epoch)
        source(None, BatchContext(seed=0, split=Split.TRAIN, epoch=epoch, index=index))
        times.append((time.perf_counter() - started) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, nargs="+", default=[30_000, 300_000, 1_280_000])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tasks", type=int, default=200, help="batch tasks timed per setting")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        image = Path(root, "class0", "0.jpg")
        image.parent.mkdir()
        image.write_bytes(bytes(8192))  # reading it costs the same at every N (the page cache holds it)
        source = ImageFolder(root=root, batch_size=args.batch, val_per_class=0)
        print(f"batch {args.batch}, {args.tasks} tasks per setting; ms per batch task (median; first task)")
        print(f"{'files':>10} {'kept':>14} {'recomputed':>16} {'ratio':>7} {'epoch CPU-s kept':>17} "
              f"{'recomputed':>11}")
        for n in args.files:
            source.files[Split.TRAIN] = [(str(image), 0)] * n
            kept = per_task_ms(source, 1, args.tasks, recompute=False)
            again = per_task_ms(source, 2, args.tasks, recompute=True)
            tasks = source.num_batches(Split.TRAIN)
            epoch_kept = (kept[0] + statistics.median(kept[1:]) * (tasks - 1)) / 1000
            epoch_again = statistics.median(again) * tasks / 1000
            print(f"{n:>10} {statistics.median(kept):>7.3f}; {kept[0]:>5.1f} {statistics.median(again):>9.3f}; "
                  f"{again[0]:>5.1f} {statistics.median(again) / statistics.median(kept):>6.1f}x "
                  f"{epoch_kept:>17.1f} {epoch_again:>11.1f}")


if __name__ == "__main__":
    main()
