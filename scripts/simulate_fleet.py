"""Measure the FLEET scheduler in simulation: gap to the optimum over
one-flotilla-at-a-time schedules on small instances, speedups over the
baseline and distance to a lower bound valid for any schedule in a paper-like
setting, training-phase reallocation and joining a running stream against the
same policy without them, and the scheduler's own decision time. Prints tables, writes results.json and
Gantt PNGs to the output directory.

    python scripts/simulate_fleet.py [OUT_DIR] [--small N] [--seeds S]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from pipeline.scheduler import Baseline, Cluster, FleetE, FleetG, FleetL, Homogeneous
from pipeline.scheduler.exact import optimal_time
from pipeline.report.plots import gantt_figure
from pipeline.scheduler.simulate import SimResult, lower_bound, random_instance, simulate

POLICIES = {"baseline": Baseline(), "homogeneous": Homogeneous(), "fleet_l": FleetL(), "fleet_g": FleetG(),
            "fleet_e": FleetE()}
PHASE_THRESHOLDS = (0.02, 0.05)  # fleet_e's training-phase reallocation, against fleet_e without it
GREEDY_ALONE = FleetG(lookahead=0)  # fleet_g without the lookahead, to measure what it gains
# Summit-Dev-like nodes: 4 slots and 20 cores; preprocessing cost per image in core-seconds
CPU_SETTINGS = {"cpu-scarce (100 img/s per slot)": 0.05, "cpu-rich (500 img/s per slot)": 0.01}
# The paper's runs stop a model after 240 minutes of training (seed 000, "Experiment settings")
TIME_LIMITS = {"no time limit": None, "240-minute limit per model": 240 * 60.0}


def plot_gantt(result: SimResult, cluster: Cluster, path: str, title: str) -> None:
    """The schedule's Gantt chart (`report.plots.gantt_figure`), in hours, saved as a PNG."""
    gantt_figure(result.bars, cluster.slots, f"{title}: {result.end_time / 3600:.2f} h, "
                 f"utilisation {result.utilisation:.0%}", hours=True).savefig(path)


def small_gaps(count: int) -> dict:
    """(a) fleet_g against the exhaustive optimum over round schedules (one flotilla at a time, see
    exact.py) on random small instances; fleet_e runs flotillas side by side, outside that class, so it
    may beat that optimum (a negative gap), and so may a fleet_g flotilla split into multi_broadcast
    streams."""
    rng = random.Random(2024)
    policies = {"fleet_g": POLICIES["fleet_g"], "fleet_g, greedy alone": GREEDY_ALONE, "fleet_e": POLICIES["fleet_e"]}
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
    print(f"\n(a) gap to the optimum over round schedules (one flotilla at a time), {count} random instances "
          f"(3-6 models, 4 or 8 slots, 1-8 epochs); exact solver {statistics.mean(solve_seconds):.2f} s/instance")
    print(f"{'policy':<24}{'mean gap':>10}{'worst gap':>11}{'optimal (<1%)':>15}")
    for name, s in summary.items():
        print(f"{name:<24}{s['mean_gap']:>10.1%}{s['worst_gap']:>11.1%}{s['within_1pct']:>9}/{count}")
    return {"instances": count, "exact_seconds_mean": statistics.mean(solve_seconds), "policies": summary}


def paper_like(seeds: int, out: Path) -> dict:
    """(b) speedup over the baseline, time over the lower bound, and (c) decision time, 100 models on
    20-160 slots."""
    results = {}
    for (cpu, cost), (limit_name, limit) in ((c, t) for t in TIME_LIMITS.items() for c in CPU_SETTINGS.items()):
        setting = f"{cpu}, {limit_name}"
        print(f"\n(b) speedup over baseline, 100 models, {setting}, mean of {seeds} ensembles"
              + ("; time / lower bound for any schedule" if limit is None else ""))
        print(f"{'slots':>5}" + "".join(f"{name:>21}" for name in POLICIES))
        rows = []
        for slots in range(20, 161, 20):
            cluster = Cluster(slots // 4, 4, cores_per_node=20, prep_seconds_per_image=cost)
            runs, bounds = {name: [] for name in POLICIES}, []
            for seed in range(seeds):
                instance = random_instance(random.Random(seed), 100, cluster, epochs=(10, 60), checkpoint_seconds=30,
                                           time_limit_seconds=limit)
                bounds.append(lower_bound(instance) if limit is None else None)
                for name, policy in POLICIES.items():
                    result = simulate(instance, policy, seed=seed)
                    runs[name].append(result)
                    if seed == 0 and slots == 20 and cost == 0.05 and limit is None:
                        plot_gantt(result, cluster, str(out / f"gantt_{name}.png"), f"{name}, 100 models, 20 slots")
            baseline = [r.end_time for r in runs["baseline"]]
            row = {"slots": slots, "lower_bound_hours": statistics.mean(bounds) / 3600 if limit is None else None}
            for name, rs in runs.items():
                row[name] = {
                    "speedup": statistics.mean(b / r.end_time for b, r in zip(baseline, rs)),
                    "hours": statistics.mean(r.end_time for r in rs) / 3600,
                    "over_lower_bound": (statistics.mean(r.end_time / b for r, b in zip(rs, bounds))
                                         if limit is None else None),
                    "utilisation": statistics.mean(r.utilisation for r in rs),
                    "decision_fraction": max(r.decision_seconds / r.end_time for r in rs),
                }
            rows.append(row)
            print(f"{slots:>5}" + "".join(
                f"{row[n]['speedup']:>7.2f}x {row[n]['utilisation']:>4.0%} u"
                + (f" {row[n]['over_lower_bound']:>4.2f} lb" if limit is None else " " * 8) for n in POLICIES))
        results[setting] = rows
    worst = max(row[n]["decision_fraction"] for rows in results.values() for row in rows for n in POLICIES)
    print(f"\n(c) scheduler decision time: at most {worst:.5%} of the simulated end-to-end time")
    return {"settings": results, "decision_fraction_max": worst}


def phases(seeds: int) -> dict:
    """(d) fleet_e with training-phase reallocation against fleet_e without it (same instances; the
    simulator's loss curves are `simulate.loss_curve`): the paper-like setting, and the seed's own
    (a few models on one or two nodes of 4 slots)."""
    settings = {f"100 models, {slots} slots": (100, Cluster(slots // 4, 4, 20, 0.05), seeds)
                for slots in (20, 60, 100, 160)}
    settings.update({f"{models} models, {nodes * 4} slots": (models, Cluster(nodes, 4, 20, 0.05), 20)
                     for nodes, models in ((1, 2), (1, 4), (2, 4), (2, 8))})
    print("\n(d) training-phase reallocation: fleet_e's time without it / with it (> 1: phases help)")
    print(f"{'setting':<24}{'ensembles':>10}" + "".join(f"{f'threshold {t}':>16}" for t in PHASE_THRESHOLDS))
    results = {}
    for name, (models, cluster, count) in settings.items():
        ratios = {t: [] for t in PHASE_THRESHOLDS}
        for seed in range(count):
            instance = random_instance(random.Random(seed), models, cluster, epochs=(10, 60), checkpoint_seconds=30)
            without = simulate(instance, POLICIES["fleet_e"]).end_time
            for threshold in PHASE_THRESHOLDS:
                ratios[threshold].append(without / simulate(instance, FleetE(phase_threshold=threshold)).end_time)
        results[name] = {str(t): {"mean": statistics.mean(r), "worst": min(r), "best": max(r)}
                         for t, r in ratios.items()}
        print(f"{name:<24}{count:>10}" + "".join(
            f"{results[name][str(t)]['mean']:>10.3f}x ({results[name][str(t)]['best']:.2f})" for t in PHASE_THRESHOLDS))
    return results


def joins(seeds: int) -> dict:
    """(e) joining a running stream (`join_running`) against the same policy without it, 100 models."""
    policies = {"fleet_l": (FleetL(), FleetL(join_running=True)), "fleet_e": (FleetE(), FleetE(join_running=True))}
    print("\n(e) joining a running stream: time without joins / with them (> 1: joins help), mean of "
          f"{seeds} ensembles")
    print(f"{'slots':>5}" + "".join(f"{f'{name}, {cpu.split()[0]}':>22}" for cpu in CPU_SETTINGS for name in policies))
    rows = []
    for slots in range(20, 161, 20):
        row = {"slots": slots}
        for cpu, cost in CPU_SETTINGS.items():
            cluster = Cluster(slots // 4, 4, cores_per_node=20, prep_seconds_per_image=cost)
            instances = [random_instance(random.Random(seed), 100, cluster, epochs=(10, 60), checkpoint_seconds=30)
                         for seed in range(seeds)]
            for name, (without, with_joins) in policies.items():
                row[f"{name}, {cpu}"] = statistics.mean(
                    simulate(i, without, seed=n).end_time / simulate(i, with_joins, seed=n).end_time
                    for n, i in enumerate(instances))
        rows.append(row)
        print(f"{slots:>5}" + "".join(f"{value:>21.3f}x" for key, value in row.items() if key != "slots"))
    return {"rows": rows}


def small_gantt(out: Path) -> None:
    cluster = Cluster(2, 4, cores_per_node=20, prep_seconds_per_image=0.05)
    instance = random_instance(random.Random(5), 10, cluster, epochs=(10, 60), checkpoint_seconds=30)
    for name in ("fleet_e", "fleet_g", "baseline"):
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
    report = {"gap": small_gaps(args.small), "paper_like": paper_like(args.seeds, out), "phases": phases(args.seeds),
              "joins": joins(args.seeds)}
    small_gantt(out)
    report["wall_seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out / 'results.json'} and gantt_*.png in {report['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
