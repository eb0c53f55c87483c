"""Benchmark of a trainer's epoch boundary on the paper ensemble's families (docs/benchmarks.md, "The
epoch boundary's host copy"): the 5 architectures of `+ensemble=caltech256_paper`, --members of each
(different learning rates), one group, fused by family, as `trainer.grouping=fuse` lays them out; each
member's state is copied to host memory as the trainer keeps it at an epoch's end, timed two ways side by
side, alternating, one after the other on one group:

* each-member: every member's state built on the device and copied to the host on its own
  (`GroupStep.state` and a copy of each tensor): how the trainer kept states until 2026-11-27;
* kept-states: `GroupStep.kept_states()`, one copy of each fused tensor, as the trainer keeps them now.
  "kept" is what the trainer's loop waits for; on a GPU that is queueing clones on the device ("clones
  done" adds the wait for them, which the loop does not make), and "to host" is `KeptStates.to_host`, the
  copy into host memory that the checkpoint writer's thread makes while the group trains on (on CPU the
  copy is in host memory at once: 0). "built" is every member's checkpoint built from the host copy, which
  a checkpoint every epoch (the default) does when it is written, on that thread too.

Widths are the paper's divided by --narrow (1: the paper's own; on CPU 100 members at full width need
about 20 GB for the weights, the momentum and the copies).

    python scripts/bench_boundary.py --members 20 --narrow 8
    python scripts/bench_boundary.py --device cuda --members 20 --narrow 1 --rounds 3
"""
from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from pipeline.training.group import GroupSpec, GroupStep, Precision, to_host
from pipeline.training.members import CONF, with_defaults

PAPER = CONF / "ensemble" / "caltech256_paper.yaml"


def families(narrow: int) -> dict[str, dict]:
    """The paper ensemble's architectures (its ensemble file's models), widths divided by `narrow`."""
    models = OmegaConf.to_container(OmegaConf.load(PAPER))["ensemble"]["models"]
    return {m["name"]: {key: value // narrow if key in ("width", "growth_rate") else value
                        for key, value in m["model"].items()} for m in models}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--members", type=int, default=20, help="members of each of the 5 families")
    parser.add_argument("--narrow", type=int, default=8, help="the paper's widths divided by this")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    models = [with_defaults(f"{family}_lr{i}", model, lr=0.1 / (i + 1))
              for family, model in families(args.narrow).items() for i in range(args.members)]
    step = GroupStep(GroupSpec("paper", tuple(models), array_size=args.members), 257,
                     {"main": args.image_size}, device, 100, precision=Precision.fp32)
    random = np.random.default_rng(0)
    images = random.integers(0, 256, (args.batch, args.image_size, args.image_size, 3), dtype=np.uint8)
    labels = torch.from_numpy(random.integers(0, 257, args.batch)).to(device)
    step.train({"main": (step.normalise(images), labels)})  # momentum buffers, as after an epoch
    tensors = sum(len(state["model"]) + len(state["optimizer"]["state"])
                  for state in (step.state(name) for name in step.names))
    print(f"{platform.processor() or platform.machine()}, {args.device}, {len(models)} members in "
          f"{len(step.units)} fused arrays, widths / {args.narrow}; {tensors} tensors in their states")

    def each_member() -> dict:
        synchronize(device)
        started = time.perf_counter()
        states = {name: to_host(step.state(name)) for name in step.names}
        synchronize(device)
        kept = time.perf_counter() - started
        return {"kept": kept, "clones done": kept, "to host": 0.0, "built": 0.0, "states": states}

    def kept_states() -> dict:
        synchronize(device)  # the steps before: done, as validation's read of its results leaves them
        started = time.perf_counter()
        kept = step.kept_states()
        timed = {"kept": time.perf_counter() - started}
        synchronize(device)
        timed["clones done"] = time.perf_counter() - started
        started = time.perf_counter()
        kept.to_host()
        timed["to host"] = time.perf_counter() - started
        started = time.perf_counter()
        return {**timed, "states": {name: kept.member(name) for name in kept.names},
                "built": time.perf_counter() - started}

    ways = {"each-member": each_member, "kept-states": kept_states}
    for round_ in range(1, args.rounds + 1):
        order = list(ways) if round_ % 2 else list(ways)[::-1]
        timed = {way: ways[way]() for way in order}
        baseline = timed["each-member"]["kept"]
        for way in ways:
            t = timed[way]
            print(f"round {round_} {way:12s} kept {t['kept']:7.3f} s ({t['kept'] / baseline:.2f}x)   clones done "
                  f"{t['clones done']:7.3f} s   to host {t['to host']:7.3f} s   built {t['built']:7.3f} s   all "
                  f"{(t['clones done'] + t['to host'] + t['built']) / baseline:.2f}x")
        one, other = (timed[way]["states"] for way in ways)
        assert all(torch.equal(one[name]["model"][key], t) for name in one
                   for key, t in other[name]["model"].items()), "the two ways copied different states"


if __name__ == "__main__":
    main()
