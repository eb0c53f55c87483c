"""Benchmark of a run across hosts (docs/topologies.md, "Across hosts: figures").

Real hosts as the tests make them (tests/hosts.py: network namespaces on one
bridge, addresses in TEST-NET-2): a Dask scheduler, the node agents and the
driver (`python -m pipeline`) each on a host of its own.

* one host against two: the same consume-only config (4 tiny ResNets on one
  stream, 4 slots, scheduler=shared) on one agent with 2 Dask workers
  (cluster.nodes=1) and on two agents with 1 worker each (cluster.nodes=2),
  for each topology: images/s per trainer (as scripts/bench_topology.py
  takes them: epochs 1.. over the trainers' step spans) and the bytes that
  crossed between hosts per image of an epoch (every host's veth counters:
  what each host sent into the bridge), beside the hubs' collective bytes
  and the image's own (uint8 pixels and an int64 label);
* a lost host: 3 training models on 2 slots a node (scheduler=baseline):
  node 0 holds two of them, node 1 one and a free slot. Once every model
  has finished its first epoch, node 0's agent and everything under it are
  SIGKILLed; from the driver's lines as they come (one clock, this
  process's): the kill to "node 0 lost", to a lost model's new flotilla,
  and to that model's first epoch trained again on node 1 (with the time
  of its later epochs there, for scale).

All hosts share this machine's cores, so one host against two compares the
same CPU split otherwise, not twice the CPU. Needs root and iproute2.

    python scripts/bench_hosts.py --out bench_results/hosts
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from bench_topology import ensemble_override, machine_info, summarize

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.hosts: the test hosts

from tests.hosts import PREFIX, Hosts, dask_scheduler  # noqa: E402

KEY = "0123456789abcdef" * 2  # the agents' secret, for these hosts only
HOSTS = ["scheduler", "node0", "node1", "driver"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_results/hosts"), help="folder for JSON and logs")
    parser.add_argument("--cache", type=Path, default=Path("data/bench_hosts"),
                        help="where the synthetic datasets are generated (once) and kept")
    parser.add_argument("--topologies", nargs="+", default=["single_broadcast", "all_shared"])
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the one-vs-two runs; the first is a warm-up")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--lost-epochs", type=int, default=4, help="epochs of the lost-host run")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a driver may take")
    return parser.parse_args()


def veth_sent(hosts: Hosts) -> dict[str, int]:
    """Bytes each host has sent into the bridge: received by the bridge's end of its veth."""
    return {name: int(Path(f"/sys/class/net/{PREFIX}-v{i}/statistics/rx_bytes").read_text())
            for i, name in enumerate(hosts.names)}


@contextmanager
def agents(hosts: Hosts, address: str, workers: list[int], folder: Path):
    """One agent per entry of `workers` (node i with workers[i] Dask workers), registered: their processes."""
    from distributed import Client

    from pipeline.data.executor import scheduler_workers
    from pipeline.orchestration.agent import registered_agents

    env = {**os.environ, "PIPELINE_AGENT_KEY": KEY}
    started, logs = [], []
    try:
        for node, count in enumerate(workers):
            logs.append(log := open(folder / f"agent{node}-{len(workers)}.log", "a"))
            started.append(subprocess.Popen(hosts.command(f"node{node}", [
                sys.executable, "-m", "pipeline.node", address, "--node", str(node), "--workers", str(count)]),
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))  # a host: a group
        with Client(address, timeout="30s") as client:
            deadline = time.monotonic() + 180
            while len(registered_agents(client)) < len(workers):
                if time.monotonic() > deadline or any(agent.poll() is not None for agent in started):
                    raise RuntimeError(f"the agents did not register: see {folder}/agent*.log")
                time.sleep(0.2)
        yield started
    finally:
        for agent in started:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        for agent in started:
            agent.wait(60)
        for log in logs:
            log.close()
        with Client(address, timeout="30s") as client:  # the next layout starts from no worker
            deadline = time.monotonic() + 60
            while scheduler_workers(client) and time.monotonic() < deadline:
                time.sleep(0.2)


class Driver:
    """`python -m pipeline` on the driver's host; each line it prints, stamped on arrival."""

    def __init__(self, hosts: Hosts, overrides: list[str], folder: Path):
        self.folder, self.lines, self.log = folder, [], open(folder.with_suffix(".log"), "w")
        self.process = subprocess.Popen(
            hosts.command("driver", [sys.executable, "-m", "pipeline", *overrides, f"hydra.run.dir={folder}"]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PIPELINE_AGENT_KEY": KEY, "COLUMNS": "400"})  # a line is a line
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self.log.write(line)
            self.log.flush()

    def wait_for(self, pattern: str, timeout_s: float, after: float = 0.0) -> tuple[float, re.Match]:
        """The first line printed after `after` that `pattern` matches (re.search): its time and match."""
        deadline = time.monotonic() + timeout_s
        while True:
            for t, line in list(self.lines):
                if t > after and (found := re.search(pattern, line)):
                    return t, found
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"the driver printed no line matching {pattern!r}: see {self.log.name}")
            time.sleep(0.05)

    def finish(self, timeout_s: float) -> dict:
        try:
            code = self.process.wait(timeout_s)
        finally:
            self.process.kill()
            self.reader.join(10)
            self.log.close()
        if code != 0:
            raise RuntimeError(f"the driver exited with {code}: see {self.log.name}")
        return json.loads((self.folder / "results.json").read_text())


def base_overrides(address: str, nodes: int, root: Path, image_size: int) -> list[str]:
    return ["+ensemble=caltech256", f"dataset.root={root}", "dataset.synthetic=never",
            f"pipeline.image_size={image_size}", "~pipeline.stages.alt", "~pipeline.stages.crop_alt",  # one sink
            f"cluster.address={address}", f"cluster.nodes={nodes}", "trainer.slots=4"]


def one_against_two(hosts: Hosts, address: str, args: argparse.Namespace, root: Path) -> list[dict]:
    runs = []
    for workers in ([2], [1, 1]):  # the same 2 Dask workers, on one host or on two
        nodes = len(workers)
        with agents(hosts, address, workers, args.out):
            for topology in args.topologies:
                name = f"{nodes}host-{topology}"
                overrides = [*base_overrides(address, nodes, root, args.image_size), ensemble_override(4),
                             "dataset.val_per_class=0",
                             f"topology={topology}", "scheduler=shared", f"trainer.epochs={args.epochs}",
                             "trainer.consume_only=true"]
                print(f"  {name} ...", end=" ", flush=True)
                before, started = veth_sent(hosts), time.monotonic()
                results = Driver(hosts, overrides, args.runs / name).finish(args.timeout)
                sent = {host: count - before[host] for host, count in veth_sent(hosts).items()}
                record = summarize(results, args.image_size)
                images = record["train_images"] * record["epochs"]  # each image of each epoch, made once
                record.update({"name": name, "hosts": nodes, "topology": topology, "overrides": overrides,
                               "driver_wall_s": time.monotonic() - started, "sent_bytes_by_host": sent,
                               "bridge_bytes_per_image": sum(sent.values()) / images,
                               "node_bytes_per_image": sum(sent[f"node{n}"] for n in range(nodes)) / images,
                               "collective_bytes_per_image": record["collective_bytes_per_epoch"] * record["epochs"]
                               / images})
                rate = record["rate_per_trainer"]
                print(f"{rate['min']:.0f}-{rate['max']:.0f} img/s per trainer; between hosts "
                      f"{record['bridge_bytes_per_image']:.0f} B per image "
                      f"(from the nodes {record['node_bytes_per_image']:.0f}, collectives "
                      f"{record['collective_bytes_per_image']:.0f})")
                runs.append(record)
    return runs


def lost_host(hosts: Hosts, address: str, args: argparse.Namespace, root: Path) -> dict:
    models = ", ".join(f"{{name: {name}, input: main, model: {{_target_: pipeline.training.models.resnet, "
                       f"depth: 10, width: 8}}}}" for name in "ABC")
    overrides = [*base_overrides(address, 2, root, args.image_size), f"ensemble.models=[{models}]",
                 "scheduler=baseline", f"trainer.epochs={args.lost_epochs}", "topology=all_shared"]
    with agents(hosts, address, [1, 1], args.out) as started:
        driver = Driver(hosts, overrides, args.runs / "lost")
        for m in "ABC":  # every model's first epoch done (and checkpointed, unless the kill comes first)
            driver.wait_for(rf"val accuracy {m} \S+ \(epoch 1\)", args.timeout)
        os.killpg(started[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        started[0].wait()
        lost_at, _ = driver.wait_for(r"^node 0 lost", args.timeout, after=killed)
        # Only a lost model forms a flotilla again: the one node 1's free slot takes
        formed_at, formed = driver.wait_for(r"^flotilla (\d+) formed: (\w+)", args.timeout, after=killed)
        flotilla, model = formed.groups()
        again_at, _ = driver.wait_for(rf"^flotilla {flotilla}: val accuracy {model} ", args.timeout)
        results = driver.finish(args.timeout)
    lost = sorted(found[1] for _, line in driver.lines
                  if (found := re.search(r": (\w+) leaves \(node 0 lost\)", line)))
    after = [t for t, line in driver.lines if re.match(rf"flotilla {flotilla}: val accuracy {model} ", line)]
    record = {"overrides": overrides, "lost_models": lost, "resumed": model,
              "kill_to_lost_line_s": lost_at - killed, "kill_to_flotilla_formed_s": formed_at - killed,
              "kill_to_epoch_trained_again_s": again_at - killed,
              "epoch_s": statistics.median(b - a for a, b in zip(after, after[1:])),  # its epochs in the new one
              "models": {m["name"]: {"epochs": m["epochs"], "failures": m["failures"],
                                     "stints": [(s["start_epoch"], s["flotilla"]) for s in m["flotillas"]]}
                         for m in results["models"]}}
    if model not in lost:
        raise RuntimeError(f"{model} formed a flotilla after the kill but was not lost: see {driver.log.name}")
    print(f"  node 0 killed: lost line after {record['kill_to_lost_line_s']:.2f} s, {model}'s new flotilla "
          f"after {record['kill_to_flotilla_formed_s']:.1f} s, its first epoch trained again after "
          f"{record['kill_to_epoch_trained_again_s']:.1f} s (an epoch of it there: {record['epoch_s']:.1f} s)")
    return record


def main() -> None:
    args = parse_args()
    from pipeline.data.synthetic import generate_imagefolder

    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.runs = args.out / time.strftime("runs-%Y%m%d-%H%M%S")  # the driver's run folders: new each time
    args.runs.mkdir()
    root = args.cache.resolve()
    generate_imagefolder(root, 8, 128, seed=0)  # 8 x 128 images: 16 batches of 64 an epoch
    started = time.monotonic()
    with Hosts(HOSTS) as hosts, dask_scheduler(hosts, args.out) as address:
        print(f"{machine_info()['cores']} cores; hosts {hosts.addresses}; scheduler {address}")
        print("one host against two")
        runs = one_against_two(hosts, address, args, root)
        print("a lost host")
        lost = lost_host(hosts, address, args, root)
    report = {"machine": machine_info(), "runs": runs, "lost_host": lost, "wall_s": time.monotonic() - started}
    (args.out / "hosts.json").write_text(json.dumps(report, indent=1))
    print(f"\n{'run':<24} {'img/s per trainer (min-max)':>28} {'B/image between hosts':>22} {'from nodes':>11} "
          f"{'collectives':>12}")
    for run in runs:
        rate = run["rate_per_trainer"]
        print(f"{run['name']:<24} {rate['min']:>13.0f}-{rate['max']:<14.0f} {run['bridge_bytes_per_image']:>22.0f} "
              f"{run['node_bytes_per_image']:>11.0f} {run['collective_bytes_per_image']:>12.0f}")
    print(f"(an image and its label: {args.image_size ** 2 * 3 + 8} B)")
    print(f"\n{args.out / 'hosts.json'}; {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
