"""Benchmark of a learning-rate search (docs/benchmarks.md, hyper-parameter search): --trials values of one
model of the default ensemble (resnet10_w16), --epochs epochs each, on the default stand-in, run as the
real command side by side:

* grid: one run, the trials as members of one ensemble (ensemble.grid over optimizer.lr), fed by one
  pipeline;
* halving: the same run with successive halving (scheduler.halving.eta=--eta from epoch 1): after each
  rung only the best 1/eta of the trials go on;
* basic: a Hydra multirun of one job per trial under Hydra's basic launcher (`-m
  ensemble.models.0.optimizer.lr=...`), each job its own run: its own cluster, read and decode;
* shared: the same multirun under the project's launcher (`hydra/launcher=shared`): the jobs train as
  one run, each still with its own folder and objective.

For each: wall time of the command, preprocessing CPU-s (results.json's stage CPU, all epochs), the best
trial's validation accuracy (its best epoch) and the epochs trained in all. Rounds alternate the modes'
order, so that both see the same machine; ratios are against grid in the same round, and shared's
against basic too.

    python scripts/bench_search.py --trials 8 --epochs 3 --rounds 2 --modes grid halving basic shared
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "{name: resnet10_w16, input: main, model: {_target_: pipeline.training.models.resnet, depth: 10, width: 16}}"


def rates(trials: int) -> list[float]:
    """Log-spaced from 0.4 down, halving each time: the trials of the search."""
    return [round(0.4 / 2 ** i, 6) for i in range(trials)]


def run_mode(mode: str, args, folder: Path) -> dict:
    overrides = ["+ensemble=caltech256", f"ensemble.models=[{MODEL}]",
                 "~pipeline.stages.alt", "~pipeline.stages.crop_alt",  # the model reads the main branch only
                 f"trainer.epochs={args.epochs}", "scheduler.patience=0"]
    trials = ",".join(map(str, rates(args.trials)))
    if mode in ("basic", "shared"):
        overrides = ["-m", *overrides, f"++ensemble.models.0.optimizer.lr={trials}", f"hydra.sweep.dir={folder}"]
        overrides += ["hydra/launcher=shared"] if mode == "shared" else []
    else:
        overrides += [f"++ensemble.grid.optimizer.lr=[{trials}]", f"hydra.run.dir={folder}"]
    if mode == "halving":
        overrides.append(f"scheduler.halving.eta={args.eta}")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipeline", *overrides], cwd=REPO, capture_output=True, text=True,
                          timeout=args.timeout_s)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{mode} failed ({done.returncode}): {done.stderr[-2000:]}")
    runs = [json.loads(path.read_text()) for path in folder.rglob("results.json")]
    runs = [results for results in runs if "shared_run" not in results]  # a shared run's jobs: its views
    models = [m for results in runs for m in results["models"]]
    return {"wall_s": wall,
            "cpu_s": sum(stage["cpu_s"] for results in runs for stage in results["pipeline"]["stages"].values()),
            "best_accuracy": max(max(m["val_accuracy"]) for m in models),
            "epochs": sum(m["epochs"] for m in models)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--eta", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=("grid", "halving", "basic", "shared"),
                        default=["grid", "halving"])
    parser.add_argument("--timeout-s", type=int, default=1800)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {args.trials} trials x {args.epochs} epochs, "
          f"lr {rates(args.trials)}")
    modes = ["grid", *(mode for mode in args.modes if mode != "grid")]  # grid: the baseline of each round
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            order = modes if round_ % 2 == 0 else modes[::-1]
            measured = {mode: run_mode(mode, args, Path(scratch) / f"{round_}-{mode}") for mode in order}
            base = measured["grid"]
            for mode in modes:
                m = measured[mode]
                print(f"round {round_ + 1} {mode:8s} wall {m['wall_s']:6.1f} s ({m['wall_s'] / base['wall_s']:.2f}x)  "
                      f"preprocessing {m['cpu_s']:6.1f} CPU-s ({m['cpu_s'] / base['cpu_s']:.2f}x)  "
                      f"best accuracy {100 * m['best_accuracy']:.1f}% "
                      f"({100 * (m['best_accuracy'] - base['best_accuracy']):+.1f} points)  "
                      f"{m['epochs']} epochs trained", flush=True)
            if {"basic", "shared"} <= measured.keys():
                shared, basic = measured["shared"], measured["basic"]
                print(f"round {round_ + 1} shared vs basic: wall {shared['wall_s'] / basic['wall_s']:.2f}x, "
                      f"preprocessing {shared['cpu_s'] / basic['cpu_s']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
