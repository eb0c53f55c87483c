"""Measure the FLEET scheduler in simulation: gap to the optimum on small
instances, speedups over the baseline in a paper-like setting, and the
scheduler's own decision time. Prints tables, writes results.json and Gantt
PNGs to the output directory.

    python scripts/simulate_fleet.py [OUT_DIR] [--small N] [--seeds S]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from pipeline.scheduler import Baseline, Cluster, FleetG, FleetL, Homogeneous
from pipeline.scheduler.exact import optimal_time
from pipeline.scheduler.simulate import plot_gantt, random_instance, simulate

POLICIES = {"baseline": Baseline(), "homogeneous": Homogeneous(), "fleet_l": FleetL(), "fleet_g": FleetG()}
GREEDY_ALONE = FleetG(lookahead=0)  # fleet_g without the lookahead, to measure what it gains
# Summit-Dev-like nodes: 4 slots and 20 cores; preprocessing cost per image in core-seconds
CPU_SETTINGS = {"cpu-scarce (100 img/s per slot)": 0.05, "cpu-rich (500 img/s per slot)": 0.01}
# The paper's runs stop a model after 240 minutes of training (seed 000, "Experiment settings")
TIME_LIMITS = {"no time limit": None, "240-minute limit per model": 240 * 60.0}


def small_gaps(count: int) -> dict:
    """(a) fleet_g against the exhaustive optimum on random small instances."""
    rng = random.Random(2024)
    policies = {"fleet_g": POLICIES["fleet_g"], "fleet_g, greedy alone": GREEDY_ALONE}
    gaps = {name: [] for name in policies}
    solve_seconds = []
    for _ in range(count):
        cluster = Cluster(rng.choice([1, 2]), 4, cores_per_node=20, prep_seconds_per_image=0.05)
        instance = random_instance(rng, rng.randint(3, 6 if cluster.nodes == 1 else 5), cluster, epochs=(1, 8),
                                   checkpoint_seconds=30)
        started = time.perf_counter()
        optimum = optimal_time(instance)
        solve_seconds.append(time.perf_counter() - started)
        for name in gaps:
            gaps[name].append(simulate(instance, policies[name]).end_time / optimum - 1)
    summary = {name: {"mean_gap": statistics.mean(g), "worst_gap": max(g), "within_1pct": sum(x < 0.01 for x in g)}
               for name, g in gaps.items()}
    print(f"\n(a) gap to the optimum, {count} random instances (3-6 models, 4 or 8 slots, 1-8 epochs); "
          f"exact solver {statistics.mean(solve_seconds):.2f} s/instance on average")
    print(f"{'policy':<24}{'mean gap':>10}{'worst gap':>11}{'optimal (<1%)':>15}")
    for name, s in summary.items():
        print(f"{name:<24}{s['mean_gap']:>10.1%}{s['worst_gap']:>11.1%}{s['within_1pct']:>9}/{count}")
    return {"instances": count, "exact_seconds_mean": statistics.mean(solve_seconds), "policies": summary}


def paper_like(seeds: int, out: Path) -> dict:
    """(b) speedup over the baseline and (c) decision time, 100 models on 20-160 slots."""
    results = {}
    for (cpu, cost), (limit_name, limit) in ((c, t) for t in TIME_LIMITS.items() for c in CPU_SETTINGS.items()):
        setting = f"{cpu}, {limit_name}"
        print(f"\n(b) speedup over baseline, 100 models, {setting}, mean of {seeds} ensembles")
        print(f"{'slots':>5}" + "".join(f"{name:>24}" for name in POLICIES))
        rows = []
        for slots in range(20, 161, 20):
            cluster = Cluster(slots // 4, 4, cores_per_node=20, prep_seconds_per_image=cost)
            runs = {name: [] for name in POLICIES}
            for seed in range(seeds):
                instance = random_instance(random.Random(seed), 100, cluster, epochs=(10, 60), checkpoint_seconds=30,
                                           time_limit_seconds=limit)
                for name, policy in POLICIES.items():
                    result = simulate(instance, policy, seed=seed)
                    runs[name].append(result)
                    if seed == 0 and slots == 20 and cost == 0.05 and limit is None:
                        plot_gantt(result, cluster, str(out / f"gantt_{name}.png"), f"{name}, 100 models, 20 slots")
            baseline = [r.end_time for r in runs["baseline"]]
            row = {"slots": slots}
            for name, rs in runs.items():
                row[name] = {
                    "speedup": statistics.mean(b / r.end_time for b, r in zip(baseline, rs)),
                    "hours": statistics.mean(r.end_time for r in rs) / 3600,
                    "utilisation": statistics.mean(r.utilisation for r in rs),
                    "decision_fraction": max(r.decision_seconds / r.end_time for r in rs),
                }
            rows.append(row)
            print(f"{slots:>5}" + "".join(
                f"{row[n]['speedup']:>13.2f}x {row[n]['utilisation']:>5.0%} u" for n in POLICIES))
        results[setting] = rows
    worst = max(row[n]["decision_fraction"] for rows in results.values() for row in rows for n in POLICIES)
    print(f"\n(c) scheduler decision time: at most {worst:.5%} of the simulated end-to-end time")
    return {"settings": results, "decision_fraction_max": worst}


def small_gantt(out: Path) -> None:
    cluster = Cluster(2, 4, cores_per_node=20, prep_seconds_per_image=0.05)
    instance = random_instance(random.Random(5), 10, cluster, epochs=(10, 60), checkpoint_seconds=30)
    for name in ("fleet_g", "baseline"):
        plot_gantt(simulate(instance, POLICIES[name]), cluster, str(out / f"gantt_small_{name}.png"),
                   f"{name}, 10 models, 8 slots")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="bench_results", help="directory for results.json and PNGs")
    parser.add_argument("--small", type=int, default=40, help="random small instances for the gap")
    parser.add_argument("--seeds", type=int, default=3, help="ensembles per paper-like setting")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {"gap": small_gaps(args.small), "paper_like": paper_like(args.seeds, out)}
    small_gantt(out)
    report["wall_seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out / 'results.json'} and gantt_*.png in {report['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
