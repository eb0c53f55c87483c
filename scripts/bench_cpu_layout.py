"""Benchmark of the layout CPU slots train in (docs/benchmarks.md, CPU layout): the default ensemble's
models (+ensemble=caltech256), each trained with the trainer's own step (`GroupStep`) on synthetic uint8
batches already in memory, at its sink's image size, batch and thread count as the default run has
them, in each candidate setting:

* channels_last: the layout GPUs train in, which CPU slots trained in before; oneDNN's channels-last
  convolution backward hangs or corrupts the heap on AVX2-only CPUs at small channel counts;
* contiguous: NCHW, with oneDNN (what CPU slots train in: `training_memory_format`);
* channels_last, avx: oneDNN held to its AVX kernels (ONEDNN_MAX_CPU_ISA=AVX), which step around the bug;
* channels_last, no oneDNN / contiguous, no oneDNN: torch's own convolutions
  (torch.backends.mkldnn.enabled = False).

Each model and setting runs in a process of its own (oneDNN reads its ISA cap once a process), the settings
interleaved `--repeats` times; the median counts. A process that hangs past `--timeout` or dies is
reported as such. Printed: images/s per model and setting, and the ratio to channels_last.

    python scripts/bench_cpu_layout.py --out bench_results/cpu_layout
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pipeline.runtime.lifetime import how_it_ended

# name -> (memory format, oneDNN on, environment)
SETTINGS = {
    "channels_last": ("channels_last", True, {}),
    "contiguous": ("contiguous_format", True, {}),
    "channels_last, avx": ("channels_last", True, {"ONEDNN_MAX_CPU_ISA": "AVX"}),
    "channels_last, no oneDNN": ("channels_last", False, {}),
    "contiguous, no oneDNN": ("contiguous_format", False, {}),
}
BASELINE = "channels_last"


def _default_run():
    """The default command's models, image sizes, batch, threads and classes, as Hydra composes them."""
    from hydra import compose, initialize_config_dir

    from pipeline.config import expand_ensemble, register
    from pipeline.training.members import CONF

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+ensemble=caltech256"])
    sizes = {"main": cfg.pipeline.image_size, "alt": cfg.pipeline.alt_image_size}
    return expand_ensemble(cfg.ensemble, cfg.seed), sizes, cfg.pipeline.batch_size, cfg.trainer.threads, \
        cfg.dataset.synthetic_classes


def _child(model_name: str, setting: str, steps: int, warmup: int) -> None:
    """Process entry point: times `steps` steps of one model in one setting; prints images/s as JSON."""
    import torch

    from pipeline.training.group import GroupSpec, GroupStep

    memory_format, onednn, _ = SETTINGS[setting]
    models, sizes, batch, threads, classes = _default_run()
    (model,) = [m for m in models if m.name == model_name]
    torch.set_num_threads(threads)
    torch.backends.mkldnn.enabled = onednn
    step = GroupStep(GroupSpec(model.name, (model,)), classes, sizes, "cpu", warmup + steps,
                     threads=threads, memory_format=getattr(torch, memory_format))
    random = np.random.default_rng(0)
    images = random.integers(0, 256, (batch, sizes[model.input], sizes[model.input], 3), dtype=np.uint8)
    inputs = {model.input: (step.normalise(images), torch.from_numpy(random.integers(0, classes, batch)))}
    for _ in range(warmup):
        step.train(inputs)
    started = time.perf_counter()
    for _ in range(steps):
        losses = step.train(inputs)
    float(losses[model.name])
    print(json.dumps({"images_per_s": batch * steps / (time.perf_counter() - started)}))


def _measure(model: str, setting: str, args) -> float | str:
    """images/s, or why there is none (a hang, a signal, an exit code)."""
    command = [sys.executable, __file__, "--child", model, setting, "--steps", str(args.steps),
               "--warmup", str(args.warmup)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, **SETTINGS[setting][2]})  # killed on a timeout
    except subprocess.TimeoutExpired:
        return f"hung (> {args.timeout:g} s)"
    if done.returncode:
        return f"{how_it_ended(done.returncode)}: {done.stderr.strip().splitlines()[-1:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])["images_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120, help="seconds one model and setting may take")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "SETTING"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("bench_results/cpu_layout"))
    args = parser.parse_args()
    if args.child:
        return _child(*args.child, args.steps, args.warmup)
    models, sizes, batch, threads, _ = _default_run()
    runs: dict[tuple[str, str], list] = {(m.name, s): [] for m in models for s in args.settings}
    for _ in range(args.repeats):  # interleaved: drift in the machine's speed reaches every setting alike
        for m in models:
            for setting in args.settings:
                runs[m.name, setting].append(_measure(m.name, setting, args))
    cpu = _cpu()
    print(f"{cpu['model']} ({cpu['isa']}), batch {batch}, {threads} thread(s), median of {args.repeats}")
    print(f"{'model':>16} {'px':>4} " + " ".join(f"{s:>26}" for s in args.settings))
    rows = []
    for m in models:
        row = {"model": m.name, "image_size": sizes[m.input]}
        for setting in args.settings:
            rates = runs[m.name, setting]
            numbers = [r for r in rates if isinstance(r, float)]
            row[setting] = statistics.median(numbers) if len(numbers) == len(rates) else next(
                r for r in rates if isinstance(r, str))
        rows.append(row)
        base = row.get(BASELINE)
        cells = []
        for setting in args.settings:
            value = row[setting]
            if isinstance(value, str):
                cells.append(f"{value:>26}")
            else:
                ratio = f" ({value / base:.2f}x)" if isinstance(base, float) else ""
                cells.append(f"{value:>17.0f}{ratio:>9}")
        print(f"{m.name:>16} {sizes[m.input]:>4} " + " ".join(cells), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_layout.json").write_text(json.dumps({
        "machine": {"platform": platform.platform(), **cpu}, "batch": batch, "threads": threads,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "child")}, "rows": rows}, indent=1))


def _cpu() -> dict:
    """The CPU's model name and the widest vector ISA torch's kernels use on it (AVX2, AVX512, ...)."""
    import torch

    from pipeline.training.rates import cpu_model

    return {"model": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability()}


if __name__ == "__main__":
    main()
