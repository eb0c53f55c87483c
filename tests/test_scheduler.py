"""Scheduler state machine, planner, policies, simulator and exact solver (no devices)."""

import random

import pytest

from pipeline.scheduler import (AssignSlots, Baseline, Checkpoint, Cluster, EpochFinished, FleetE, FleetG, FleetL,
                                FormFlotilla, GroupConverged, Homogeneous, NodeLost, NodeReturned, PrepCostMeasured,
                                RateTable, RatesMeasured, Scheduler, Shared, Slot, SlotFreed, Start, Stop,
                                TrainerFailed, assign_slots, greedy_flotilla, make_policy)
from pipeline.scheduler.planner import longest_first, lookahead_flotilla, share_streams, spread_slots
from pipeline.scheduler.exact import optimal_time, run_round
from pipeline.scheduler.simulate import Instance, loss_curve, lower_bound, random_instance, simulate
from pipeline.scheduler.topology import Topology, choose_topology, split_streams, stream_rate

SEED_RATES = {"DNN1": (100, 190, 270, 350), "DNN2": (80, 150, 220, 280),
              "DNN3": (80, 150, 200, 240), "DNN4": (40, 75, 105, 120)}


def seed_rates() -> RateTable:
    table = RateTable()
    for model, rates in SEED_RATES.items():
        table.add(model, rates)
    return table


def started(scheduler: Scheduler, rates: dict[str, tuple]) -> list:
    decisions = []
    for model, r in rates.items():
        decisions += scheduler.handle(RatesMeasured(0.0, model, r))
    return decisions


def of(kind, decisions):
    return [d for d in decisions if isinstance(d, kind)]


# ------------------------------------------------------------------ planner

def test_worked_example_of_the_slides():
    flotilla = greedy_flotilla(list(SEED_RATES), seed_rates(), Cluster(1, 4), [4])
    assert flotilla == {"DNN1": 1, "DNN4": 3}


def test_lookahead_scores_the_worked_example_by_completion_time():
    # equal work left per model: {DNN1:1, DNN4:3} takes 1/100, then DNN2 and DNN3 on 2 slots each 1/150;
    # {DNN2:1, DNN3:1, DNN4:2} takes 1/75, then DNN1 alone on 4 slots 1/350: 0.0162 < 0.0167
    flotilla = lookahead_flotilla(list(SEED_RATES), seed_rates(), Cluster(1, 4), [4])
    assert flotilla == {"DNN2": 1, "DNN3": 1, "DNN4": 2}


def test_every_decision_names_the_event_that_caused_it():
    """Dask's stimulus_id: a decision log can be traced back. A decision left without its cause, or given
    an earlier event's, fails."""
    scheduler = Scheduler(["a", "b"], Cluster(1, 2), FleetG(lookahead=0))
    assert scheduler.handle(RatesMeasured(0.0, "a", (10, 15))) == []  # b's rates still to come
    decisions = scheduler.handle(RatesMeasured(0.5, "b", (20, 30)))
    assert decisions and {d.cause for d in decisions} == {
        "RatesMeasured(group=b, rates=(20, 30), start_s=0.0) at 0.500 s"}
    stops = scheduler.handle(GroupConverged(2.25, "b"))  # b runs on both slots (a waits)
    assert of(Stop, stops) and {d.cause for d in stops} == {"GroupConverged(group=b, reason=converged) at 2.250 s"}
    fresh = Scheduler(["a"], Cluster(1, 1), Shared({"a": 1}))  # plans without rates
    assert {d.cause for d in fresh.start(1.0)} == {"start at 1.000 s"}


def test_worked_example_through_the_state_machine():
    scheduler = Scheduler(list(SEED_RATES), Cluster(1, 4), FleetG(lookahead=0))
    decisions = started(scheduler, SEED_RATES)
    assert [type(d) for d in decisions] == [FormFlotilla, AssignSlots, AssignSlots, Start, Start]
    form = decisions[0]
    assert form.members == {"DNN1": 1, "DNN4": 3} and form.rate == 100
    assert {d.group: len(d.slots) for d in of(AssignSlots, decisions)} == {"DNN1": 1, "DNN4": 3}
    assert all(d.resume_epoch == 0 for d in of(Start, decisions))


def test_measured_preprocessing_cost_caps_the_flotillas_planned_after_it():
    # 8 cores for 4 slots at 10 ms per image: 200 img/s per slot, above every flotilla's slowest member
    scheduler = Scheduler(list(SEED_RATES), Cluster(1, 4, cores_per_node=8), FleetG(lookahead=0))
    assert scheduler.handle(PrepCostMeasured(0.0, 0.01)) == []  # no rates yet: nothing planned
    first = of(FormFlotilla, started(scheduler, SEED_RATES))[0]
    assert first.members == {"DNN1": 1, "DNN4": 3} and first.rate == 100
    # The run measures 80 ms per image: 8 / 4 / 0.08 = 25 img/s per slot caps the next flotilla at 25 x its slots
    scheduler.handle(PrepCostMeasured(1.0, 0.08))
    assert scheduler.state()["prep_seconds_per_image"] == 0.08
    for model in first.members:
        scheduler.handle(EpochFinished(2.0, model, 1))
        scheduler.handle(GroupConverged(2.0, model))
    replan = []
    for slot in Cluster(1, 4).slots:
        replan += scheduler.handle(SlotFreed(4.0, slot))
    second = of(FormFlotilla, replan)[0]
    assert second.rate == 25 * sum(second.members.values())
    restored = Scheduler(list(SEED_RATES), Cluster(1, 4, cores_per_node=8), FleetG(lookahead=0))
    restored.restore(scheduler.state())
    assert restored.cluster.prep_seconds_per_image == 0.08


def test_slot_assignment_keeps_multi_slot_models_on_one_node_and_packs_small_ones():
    free = list(Cluster(3, 4).slots)
    placement = assign_slots({"a": 3, "b": 1, "c": 2, "d": 2, "e": 4}, free)
    for slots in placement.values():
        assert len({s.node for s in slots}) == 1
    assert placement["b"][0].node == placement["a"][0].node  # the 1-slot model fills the 3-slot node
    used = [s for slots in placement.values() for s in slots]
    assert len(used) == len(set(used)) == 12


def test_impossible_requests_say_what_and_how_to_fix():
    with pytest.raises(ValueError, match="needs 3 slots on one node"):
        assign_slots({"a": 3}, [Slot(0, 0), Slot(0, 1), Slot(1, 0)])
    scheduler = Scheduler(["big"], Cluster(2, 2), FleetG())
    with pytest.raises(ValueError, match="must fit in one node of 2 slots"):
        scheduler.handle(RatesMeasured(0.0, "big", (0, 0, 0, 300)))
    with pytest.raises(ValueError, match="unknown group 'x'"):
        scheduler.handle(EpochFinished(0.0, "x", 1))


def test_policies_are_selectable_by_name():
    assert isinstance(make_policy("fleet_g"), FleetG) and isinstance(make_policy("fleet_l"), FleetL)
    assert make_policy("fleet_e", phase_threshold=0.02) == FleetE(phase_threshold=0.02)
    assert isinstance(make_policy("baseline"), Baseline) and isinstance(make_policy("homogeneous"), Homogeneous)
    assert make_policy("fleet_l", min_active_fraction=0.5).min_active_fraction == 0.5


# ------------------------------------------------------------ state machine

FIVE = {"a": (100, 190), "b": (100, 190), "c": (100, 190), "d": (100, 190), "e": (100, 190)}


def five_on_five(policy) -> Scheduler:
    scheduler = Scheduler(list(FIVE), Cluster(5, 1), policy)
    form = of(FormFlotilla, started(scheduler, FIVE))
    assert len(form) == 1 and form[0].members == dict.fromkeys(FIVE, 1)
    return scheduler


def test_converged_model_is_checkpointed_and_released_and_flotilla_stops_below_80_percent():
    scheduler = five_on_five(FleetG())
    for model in FIVE:
        scheduler.handle(EpochFinished(10.0, model, 1))
    first = scheduler.handle(GroupConverged(10.0, "a"))
    assert first == [Checkpoint(0, "a", 1, final=True), Stop(0, "a", "converged", flotilla_ends=False)]
    second = scheduler.handle(GroupConverged(11.0, "b"))  # 3 of 5 slots active: 60% < 80%
    assert of(Stop, second) == [Stop(0, "b", "converged", False), Stop(0, "c", "flotilla stopped", False),
                                Stop(0, "d", "flotilla stopped", False), Stop(0, "e", "flotilla stopped", True)]
    assert {d.group for d in of(Checkpoint, second)} == {"b", "c", "d", "e"}
    replan = []
    for slot in Cluster(5, 1).slots:
        replan += scheduler.handle(SlotFreed(12.0, slot))
    assert of(FormFlotilla, replan)[0].members.keys() == {"c", "d", "e"}
    assert {d.group: d.resume_epoch for d in of(Start, replan)} == {"c": 1, "d": 1, "e": 1}


def test_fleet_g_waits_for_the_flotilla_to_stop_while_fleet_l_refills_at_once():
    rates = {**FIVE, "f": (100, 190)}  # one model more than slots
    decisions = {}
    for policy in (FleetG(), FleetL()):
        scheduler = Scheduler(list(rates), Cluster(5, 1), policy)
        started(scheduler, rates)
        scheduler.handle(EpochFinished(1.0, "a", 1))
        scheduler.handle(GroupConverged(1.0, "a"))
        decisions[type(policy)] = scheduler.handle(SlotFreed(2.0, Slot(0, 0)))
    assert decisions[FleetG] == []
    refill = decisions[FleetL]
    form = refill[0]
    assert (form.flotilla, form.members, form.rate) == (1, {"f": 1}, 100.0)
    assert (form.topology, form.streams) == ("single_broadcast", (("f",),)) and of(Start, refill) == [Start(1, "f", 0)]


def test_fleet_l_fills_every_free_slot_at_once_fleet_g_one_flotilla_at_a_time():
    # the fastest, alone within tolerance, is the greedy's reference (no model is critical); more slots
    # only slow a model down
    rates = {"a": (300.0, 250.0, 200.0, 150.0), **{m: (200.0, 160.0, 120.0, 100.0) for m in "cdef"}}
    formed = {}
    for policy in (FleetG(), FleetL()):
        scheduler = Scheduler(list(rates), Cluster(1, 4), policy)
        formed[type(policy)] = [d.members for d in of(FormFlotilla, started(scheduler, rates))]
    assert formed[FleetG] == [{"a": 1}]  # 3 slots wait for that flotilla to end
    assert formed[FleetL] == [{"a": 1}, {"c": 1, "d": 1, "e": 1}]


def test_failed_trainer_resumes_from_last_checkpoint_and_is_given_up_after_max_failures():
    scheduler = Scheduler(["m"], Cluster(1, 1), FleetG(), checkpoint_every=2, max_failures=1)
    started(scheduler, {"m": (50,)})
    scheduler.handle(EpochFinished(1.0, "m", 1))
    assert scheduler.handle(EpochFinished(2.0, "m", 2)) == [Checkpoint(0, "m", 2)]
    scheduler.handle(EpochFinished(3.0, "m", 3))
    assert scheduler.handle(TrainerFailed(3.5, "m", Slot(0, 0), "CUDA error")) == [Stop(0, "m", "failed", True)]
    assert of(Start, scheduler.handle(SlotFreed(4.0, Slot(0, 0)))) == [Start(1, "m", 2)]
    scheduler.handle(TrainerFailed(5.0, "m", Slot(0, 0)))
    assert scheduler.handle(SlotFreed(6.0, Slot(0, 0))) == [] and scheduler.done
    assert scheduler.groups["m"].status == "failed"


def test_a_lost_node_fails_its_models_stops_its_flotillas_and_its_slots_wait_until_it_returns():
    rates = {"a": (100,), "b": (100,), "c": (100,)}
    scheduler = Scheduler(list(rates), Cluster(3, 1), FleetL(), checkpoint_every=2, max_failures=1)
    first = started(scheduler, rates)
    assert [d.slots for d in of(AssignSlots, first)] == [(slot,) for slot in Cluster(3, 1).slots]  # a, b, c
    assert [d.members for d in of(FormFlotilla, first)] == [dict.fromkeys(rates, 1)]
    for epoch in (1, 2, 3):  # checkpointed after epoch 2
        for model in rates:
            scheduler.handle(EpochFinished(float(epoch), model, epoch))
    lost = scheduler.handle(NodeLost(3.5, 1))
    assert lost == [Stop(0, m, "node 1 lost", flotilla_ends=m == "c") for m in "abc"]  # the flotilla spans it
    assert [scheduler.groups[m].failures for m in "abc"] == [0, 1, 0]  # only the model on it failed
    assert {m: (s.status, s.epochs_done) for m, s in scheduler.groups.items()} == dict.fromkeys(rates, ("waiting", 2))
    assert scheduler.handle(NodeLost(3.6, 1)) == []  # told twice: once
    replan = []
    for slot in Cluster(3, 1).slots:  # node 1's slot stays lost
        replan += scheduler.handle(SlotFreed(4.0, slot))
    again = of(AssignSlots, replan)
    assert {d.group for d in again} == {"a", "b"} and {d.slots for d in again} == {(Slot(0, 0),), (Slot(2, 0),)}
    assert of(Start, replan) == [Start(1, "a", 2), Start(1, "b", 2)] and not scheduler.stranded
    assert scheduler.slots[Slot(1, 0)] == "lost"
    assert of(Start, scheduler.handle(NodeReturned(5.0, 1))) == [Start(2, "c", 2)]  # its slot in the next plan
    with pytest.raises(ValueError, match="node 1 returned but was not lost"):
        scheduler.handle(NodeReturned(6.0, 1))


def test_models_no_slot_left_can_take_are_stranded_until_their_node_returns():
    scheduler = Scheduler(["a", "b"], Cluster(2, 1), Shared({"a": 1, "b": 1}))  # both at once, or neither
    assert len(of(Start, scheduler.start(0.0))) == 2
    scheduler.handle(NodeLost(1.0, 0))
    assert scheduler.handle(SlotFreed(2.0, Slot(1, 0))) == [] and scheduler.stranded == ["a", "b"]
    assert not scheduler.done
    assert len(of(Start, scheduler.handle(NodeReturned(3.0, 0)))) == 2 and scheduler.stranded == []


def test_driver_mistakes_are_refused():
    scheduler = Scheduler(["m"], Cluster(1, 1), FleetG())
    started(scheduler, {"m": (50,)})
    with pytest.raises(ValueError, match="was freed but is busy"):
        scheduler.handle(SlotFreed(1.0, Slot(0, 0)))
    with pytest.raises(ValueError, match="older than the scheduler's clock"):
        scheduler.handle(EpochFinished(0.5, "m", 1))


def test_late_convergence_of_a_stopped_model_counts():
    scheduler = five_on_five(FleetG(min_active_fraction=1.0))
    scheduler.handle(GroupConverged(1.0, "a"))  # stops the whole flotilla
    assert scheduler.handle(GroupConverged(1.0, "b")) == []
    assert scheduler.groups["b"].status == "converged"


# --------------------------------------------------------------- simulation

POLICIES = [FleetG(), FleetL(), Baseline(), Homogeneous(), FleetG(lookahead=0), FleetE(),
            FleetE(phase_threshold=0.05)]


def small_instance(seed: int, nodes: int = 2) -> Instance:
    cluster = Cluster(nodes, 4, cores_per_node=8, prep_seconds_per_image=0.02)
    return random_instance(random.Random(seed), 9, cluster, epochs=(2, 12), images_per_epoch=3000,
                           checkpoint_seconds=5.0)


def policy_id(policy) -> str:
    return (type(policy).__name__ + ("-greedy-alone" if getattr(policy, "lookahead", 1) == 0 else "")
            + ("-phases" if getattr(policy, "phase_threshold", 0) else ""))


@pytest.mark.parametrize("policy", POLICIES, ids=policy_id)
def test_simulation_invariants(policy):
    instance = small_instance(3)
    result = simulate(instance, policy, seed=1)
    by_slot = {}
    for bar in result.bars:
        by_slot.setdefault(bar.slot, []).append(bar)
    for bars in by_slot.values():  # no slot double-booked
        bars.sort(key=lambda b: b.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(bars, bars[1:]))
    runs = {}
    for bar in result.bars:
        runs.setdefault((bar.group, bar.flotilla), []).append(bar)
    for bars in runs.values():  # a multi-slot model stays within one node
        assert len({b.slot.node for b in bars}) == 1
    # simulate() raises unless every model converged; each one did train
    assert {model for model, _ in runs} == instance.epochs.keys()
    assert result.end_time >= lower_bound(instance) * (1 - 1e-9)
    again = simulate(instance, policy, seed=1)
    assert (again.end_time, again.bars) == (result.end_time, result.bars)  # deterministic


def test_a_time_limit_stops_a_model_at_the_end_of_the_epoch_that_reaches_it():
    """Utilisation not taken over both slots (busy seconds over the end time: 1.875) fails."""
    table = RateTable({"slow": (100.0,), "fast": (200.0,)})
    instance = Instance(table, {"slow": 10, "fast": 10}, Cluster(2, 1), images_per_epoch=1000,
                        time_limit_seconds=35.0)
    result = simulate(instance, Baseline())
    # slow: 10 s epochs, stopped after its 4th (40 s); fast: 5 s epochs, stopped after its 7th (35 s)
    assert sorted((bar.group, bar.end - bar.start) for bar in result.bars) == [("fast", 35.0), ("slow", 40.0)]
    assert result.end_time == 40.0
    assert result.utilisation == (35 + 40) / (2 * 40.0)  # busy slot-seconds over the 2 slots' 40 s


def test_baseline_and_homogeneous_use_one_slot_per_model():
    instance = small_instance(4)
    for policy in (Baseline(), Homogeneous()):
        result = simulate(instance, policy)
        slots_per_run = {}
        for bar in result.bars:
            slots_per_run[(bar.group, bar.flotilla)] = slots_per_run.get((bar.group, bar.flotilla), 0) + 1
        assert set(slots_per_run.values()) == {1}
    baseline = simulate(instance, Baseline())
    assert baseline.flotillas == len(instance.epochs)  # one pipeline per model
    homogeneous = simulate(instance, Homogeneous())
    spans = {}
    for bar in homogeneous.bars:
        start, end = spans.get(bar.flotilla, (bar.start, bar.end))
        spans[bar.flotilla] = (min(start, bar.start), max(end, bar.end))
    ordered = sorted(spans.values())
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(ordered, ordered[1:]))  # next subset after the previous


def test_cpu_model_caps_rates_and_sharing_preprocesses_once():
    table = RateTable()
    table.add("fast", (200,))
    table.add("slow", (150,))
    cluster = Cluster(1, 2, cores_per_node=2, prep_seconds_per_image=0.01)  # 100 images/s per slot
    instance = Instance(table, {"fast": 1, "slow": 1}, cluster, images_per_epoch=1000)
    assert simulate(instance, Baseline()).end_time == pytest.approx(10.0)  # each capped at 100 images/s
    assert simulate(instance, FleetG()).end_time == pytest.approx(1000 / 150)  # one pipeline, 200 images/s


def test_exact_solver_is_a_lower_bound_of_fleet_g_and_matches_the_simulator():
    for seed in range(4):
        rng = random.Random(seed)
        instance = random_instance(rng, 4, Cluster(rng.choice([1, 2]), 4), epochs=(1, 6), images_per_epoch=3000)
        optimum = optimal_time(instance)
        assert optimum <= simulate(instance, FleetG()).end_time * (1 + 1e-9)
        assert optimum <= simulate(instance, FleetG(lookahead=0)).end_time * (1 + 1e-9)
    table = RateTable()
    table.add("m", (100, 150))
    alone = Instance(table, {"m": 3}, Cluster(1, 2), images_per_epoch=300, checkpoint_seconds=1.0)
    assert optimal_time(alone) == pytest.approx(3 * 300 / 150 + 1.0)
    assert simulate(alone, FleetG()).end_time == pytest.approx(optimal_time(alone))


def test_a_flotilla_flows_once_its_slowest_member_has_started_in_the_plan_the_simulator_and_the_optimum():
    """A group's start (compiling: RateTable.start) delays its flotilla's stream by its longest member's,
    once per flotilla: two models of 2 and 3 epochs of 300 images at 100 images/s on one flotilla of
    FLEET-G (it stops when the first leaves, the other's last epoch runs in a second flotilla, starting
    again): 3 epochs + the slower one's start twice (20 s each; the other's 5 s passes within it). The
    optimum, which counts starts the same way, runs them one after the other: 20 + 9 s, then 5 + 6 s.
    The decision carries the planned start. A start paid once, or the members' starts added up, fails."""
    table = RateTable()
    table.add("quick", (100.0,), 5.0)
    table.add("compiled", (100.0,), 20.0)
    instance = Instance(table, {"quick": 2, "compiled": 3}, Cluster(1, 2), images_per_epoch=300)
    scheduler = Scheduler(["quick", "compiled"], instance.cluster, FleetG())
    scheduler.handle(RatesMeasured(0.0, "quick", (100.0,), 5.0))
    [formed] = of(FormFlotilla, scheduler.handle(RatesMeasured(0.0, "compiled", (100.0,), 20.0)))
    assert formed.start_s == 20.0
    assert simulate(instance, FleetG()).end_time == pytest.approx(3 * 3 + 20 + 20)
    assert optimal_time(instance) == pytest.approx(20 + 9 + 5 + 6)


def test_round_model_stops_below_min_active_fraction():
    table = RateTable()
    for model, rate in {"a": 100, "b": 50, "c": 100, "d": 100, "e": 100}.items():
        table.add(model, (rate,))
    instance = Instance(table, {"a": 1, "b": 2, "c": 3, "d": 3, "e": 3}, Cluster(1, 5), images_per_epoch=100)
    duration, left = run_round(dict.fromkeys("abcde", 1), instance.epochs, instance, 0.8)
    # epoch 1 at 50/s (b slows all), a leaves (4/5 active), epoch 2 at 50/s, b leaves (3/5): stop
    assert duration == pytest.approx(4.0)
    assert left == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1}


def test_fleet_g_is_near_the_optimum_on_fixed_small_instances():
    """The generator of scripts/simulate_fleet.py (a); the docs report all 40."""
    rng, gaps = random.Random(2024), {0: [], 8: []}
    for _ in range(8):
        cluster = Cluster(rng.choice([1, 2]), 4, cores_per_node=20, prep_seconds_per_image=0.05)
        instance = random_instance(rng, rng.randint(3, 6 if cluster.nodes == 1 else 5), cluster, epochs=(1, 8),
                                   checkpoint_seconds=30)
        optimum = optimal_time(instance)
        for lookahead in gaps:
            gaps[lookahead].append(simulate(instance, FleetG(lookahead=lookahead)).end_time / optimum - 1)
    mean = {lookahead: sum(g) / len(g) for lookahead, g in gaps.items()}
    assert mean[8] < 0.05 and mean[8] < mean[0] / 2, mean


# ------------------------------------------------------------------ fleet_e

def test_fleet_e_plans_longest_first_one_slot_each_and_shares_streams_only_where_cpus_hold_models_back():
    table = RateTable({"slow": (20.0, 38.0), "fast1": (176.0, 300.0), "fast2": (160.0, 290.0),
                       "mid": (90.0, 170.0), "quick": (120.0, 200.0)})
    cluster = Cluster(1, 4, cores_per_node=4, prep_seconds_per_image=0.04)  # 100 images/s per slot
    assert longest_first(list(table.rates), table, cluster) == ["slow", "mid", "quick", "fast2", "fast1"]
    # more models than slots: the slowest four, one slot each (the fastest waits)
    groups = FleetE().form(list(table.rates), table, cluster, list(cluster.slots), random.Random(0))
    assert sorted(m for g in groups for m in g) == ["fast2", "mid", "quick", "slow"]
    assert all(g == 1 for group in groups for g in group.values())
    # fast2 and quick are held back alone (above the 100 images/s of a slot's cores) but 120 < 0.8 x 160:
    # too unlike to share; slow and mid are not held back
    assert sorted(map(sorted, groups)) == [["fast2"], ["mid"], ["quick"], ["slow"]]
    assert share_streams({"fast1": 1, "fast2": 1, "slow": 1}, table, cluster) == [{"slow": 1},
                                                                                 {"fast1": 1, "fast2": 1}]
    # fewer models than slots: leftover slots go where they cut time per unit of work most (the slow one)
    assert spread_slots({"slow": 1, "fast1": 1}, table, [4]) == {"slow": 2, "fast1": 2}


def elastic_run(policy: FleetE, start_s: float = 0.0, **work) -> tuple[Scheduler, list]:
    """Two models on a node of 4 slots, nothing waiting: fleet_e spreads them over 2 slots each. `start_s`:
    a's start; `work`: the Scheduler's epochs and images_per_epoch."""
    rates = {"a": (50.0, 95.0, 135.0, 170.0), "b": (60.0, 110.0, 150.0, 180.0)}
    scheduler = Scheduler(list(rates), Cluster(1, 4), policy, **work)
    first = [d for m, r in rates.items() for d in scheduler.handle(RatesMeasured(0.0, m, r, start_s * (m == "a")))]
    return scheduler, first


@pytest.mark.parametrize("start_s, epochs, restarts", [(0.0, 4, True), (30.0, 10, True), (40.0, 10, False),
                                                       (30.0, 4, False)])
def test_fleet_e_restarts_a_model_only_where_the_time_it_saves_outweighs_its_start(start_s, epochs, restarts):
    """a, after 3 of at most `epochs` epochs of 1,000 images, could go from 2 slots (95 images/s) to 4
    (170): 4.64 ms an image saved, 32.5 s on 7 epochs left, 4.6 s on 1. It restarts where that is more
    than its start (compiling): a start ignored, or the run's whole work counted, fails."""
    scheduler, first = elastic_run(FleetE(), start_s, epochs=epochs, images_per_epoch=1000)
    scheduler.handle(EpochFinished(10.0, "b", 1))
    scheduler.handle(GroupConverged(10.0, "b"))
    for slot in of(AssignSlots, first)[1].slots:
        scheduler.handle(SlotFreed(11.0, slot))
    decisions = scheduler.handle(EpochFinished(12.0, "a", 3))
    assert [d.reason for d in of(Stop, decisions)] == (["resized"] if restarts else [])


def test_fleet_e_restarts_a_model_on_idle_slots_from_the_epoch_it_just_finished():
    scheduler, first = elastic_run(FleetE())
    assert {d.group: len(d.slots) for d in of(AssignSlots, first)} == {"a": 2, "b": 2}
    scheduler.handle(EpochFinished(10.0, "b", 1))
    converged = scheduler.handle(GroupConverged(10.0, "b"))
    assert of(Stop, converged)[0].reason == "converged"
    for slot in of(AssignSlots, first)[1].slots:
        assert scheduler.handle(SlotFreed(11.0, slot)) == []  # nobody waits: the slots stay idle...
    resized = scheduler.handle(EpochFinished(12.0, "a", 3))  # ...until a's epoch ends: it restarts on all 4
    assert resized == [Checkpoint(0, "a", 3), Stop(0, "a", "resized", flotilla_ends=True)]
    replan = []
    for slot in of(AssignSlots, first)[0].slots:
        replan += scheduler.handle(SlotFreed(13.0, slot))
    assert of(FormFlotilla, replan)[0].members == {"a": 4} and of(Start, replan) == [Start(2, "a", 3)]
    assert scheduler.handle(EpochFinished(14.0, "a", 4)) == [Checkpoint(2, "a", 4)]  # no gain left: stays


def test_fleet_e_phases_move_slots_from_a_plateaued_model_to_one_still_improving():
    scheduler, first = elastic_run(FleetE(phase_threshold=0.05))
    slots = {d.group: d.slots for d in of(AssignSlots, first)}
    scheduler.handle(EpochFinished(10.0, "a", 1, {"train_loss": 4.0}))
    scheduler.handle(EpochFinished(10.0, "b", 1, {"train_loss": 3.0}))
    assert scheduler.handle(EpochFinished(20.0, "b", 2, {"train_loss": 2.0})) == [Checkpoint(1, "b", 2)]
    # a's loss fell 2% (< 5%): on its plateau; b's still falls 33% and would gain from a's second slot
    assert of(Stop, scheduler.handle(EpochFinished(21.0, "a", 2, {"train_loss": 3.92}))) == [
        Stop(0, "a", "plateau", flotilla_ends=True)]
    replan = []
    for slot in slots["a"]:
        replan += scheduler.handle(SlotFreed(22.0, slot))
    assert of(FormFlotilla, replan)[0].members == {"a": 1} and of(Start, replan) == [Start(2, "a", 2)]
    # b, still improving, takes the slot a gave up at its next epoch end: 3 slots
    assert of(Stop, scheduler.handle(EpochFinished(30.0, "b", 3, {"train_loss": 1.5})))[0].reason == "resized"
    replan = []
    for slot in slots["b"]:
        replan += scheduler.handle(SlotFreed(31.0, slot))
    assert of(FormFlotilla, replan)[0].members == {"b": 3}
    # without phases a keeps its two slots
    scheduler, _ = elastic_run(FleetE())
    scheduler.handle(EpochFinished(10.0, "a", 1, {"train_loss": 4.0}))
    assert of(Stop, scheduler.handle(EpochFinished(21.0, "a", 2, {"train_loss": 3.92}))) == []


def test_fleet_e_restarts_a_model_only_for_slots_the_planner_would_give_it():
    """a's rates dip at 2 slots (100, 95, 180, 240: noise, or a CPU host where 2 slots are slower than 1).
    The planner adds a slot only while one more is faster, so a restart lands on 1 slot again: a stays. It
    was stopped "resized" after every epoch (its best rate, 240 on 4, was within reach of no plan), each time
    paying a checkpoint and a start."""
    scheduler = Scheduler(["a"], Cluster(1, 4), FleetE())
    first = scheduler.handle(RatesMeasured(0.0, "a", (100.0, 95.0, 180.0, 240.0)))
    assert {d.group: len(d.slots) for d in of(AssignSlots, first)} == {"a": 1}
    assert [of(Stop, scheduler.handle(EpochFinished(10.0 * epoch, "a", epoch))) for epoch in (1, 2, 3)] == [[]] * 3


def test_fleet_e_with_join_running_restarts_a_resized_model_on_more_slots_not_into_a_stream():
    """join_running: a, restarting to take the slots c left, formed a flotilla of its own on 3 slots. It
    joined b's stream again on its fewest (1), where it was stopped "resized" once more, every epoch, the
    other slots idle."""
    scheduler = Scheduler(list("abc"), Cluster(1, 4, cores_per_node=4, prep_seconds_per_image=0.02),
                          FleetE(join_running=True), epochs=30, images_per_epoch=10000)
    first = started(scheduler, {m: (100.0, 180.0, 250.0, 300.0) for m in "abc"})
    assert {d.group: len(d.slots) for d in of(AssignSlots, first)} == {"c": 2, "a": 1, "b": 1}

    def freed(at: float) -> list:
        return [d for slot, state in list(scheduler.slots.items()) if state == "releasing"
                for d in scheduler.handle(SlotFreed(at, slot))]

    scheduler.handle(GroupConverged(1.0, "c"))
    freed(1.5)
    assert of(Stop, scheduler.handle(EpochFinished(2.0, "a", 1))) == [Stop(1, "a", "resized", flotilla_ends=False)]
    replanned = scheduler.handle(EpochFinished(3.0, "b", 1)) + freed(3.5)
    assert [f.members for f in of(FormFlotilla, replanned)] == [{"a": 3}]
    assert of(Stop, scheduler.handle(EpochFinished(4.0, "a", 2))) == []


def test_fleet_e_takes_no_slot_from_a_model_on_its_plateau_for_another_on_its_plateau():
    """phase_threshold 0.1: b's loss levels off first, then a's. Neither still improves, so neither
    gives its second slot away. a gave one up "plateau" for b, whose plateau had already held it to its
    fewest slots (its rate there 0 in the planning table counted as a gain), and the slot stayed idle."""
    scheduler = Scheduler(["a", "b"], Cluster(1, 4), FleetE(phase_threshold=0.1))
    first = started(scheduler, {"a": (100.0, 190.0, 195.0, 200.0), "b": (100.0, 190.0, 270.0, 340.0)})
    assert {d.group: len(d.slots) for d in of(AssignSlots, first)} == {"a": 2, "b": 2}
    scheduler.handle(EpochFinished(10.0, "b", 1, {"train_loss": 4.0}))
    scheduler.handle(EpochFinished(10.0, "a", 1, {"train_loss": 1.0}))
    assert of(Stop, scheduler.handle(EpochFinished(20.0, "b", 2, {"train_loss": 3.9}))) == []
    assert of(Stop, scheduler.handle(EpochFinished(20.0, "a", 2, {"train_loss": 0.99}))) == []


def test_a_flotilla_joined_on_a_leavers_slot_counts_that_slot_once():
    """fleet_l with join_running, 5 slots: a converges and f joins on its slot; b converges: 4 of the
    flotilla's 5 slots are active, 0.8, so it runs on (min_active_fraction 0.8). Counted per member, a's
    and f's slot was two, 4 of 6, and c, d, e and f were stopped."""
    scheduler = Scheduler(list("abcdef"), Cluster(1, 5), make_policy("fleet_l", 0.8, join_running=True))
    formed = started(scheduler, {m: (100.0,) * 5 for m in "abcdef"})
    (flotilla,) = {d.flotilla for d in of(AssignSlots, formed)}
    waiting = [m for m in "abcdef" if scheduler.groups[m].status == "waiting"]
    first = next(m for m in "abcdef" if m not in waiting)
    scheduler.handle(GroupConverged(1.0, first))
    joined = [d for slot, state in list(scheduler.slots.items()) if state == "releasing"
              for d in scheduler.handle(SlotFreed(1.5, slot))]
    assert [d.group for d in of(AssignSlots, joined)] == waiting  # on the slot the leaver freed
    second = next(m for m in "abcdef" if m not in (first, *waiting))
    stopped = scheduler.handle(GroupConverged(2.0, second))
    assert [d.reason for d in of(Stop, stopped)] == ["converged"] and len(scheduler.flotillas[flotilla].active) == 4


def test_loss_curves_level_off_at_convergence_and_the_lower_bound_holds_for_every_schedule():
    for epochs in (2, 10, 60):
        curve = loss_curve(epochs)
        drops = [(a - b) / a for a, b in zip((5.5, *curve), curve)]
        assert len(curve) == epochs and all(d > 0 for d in drops)
        assert drops[-1] == pytest.approx(0.01) and all(a >= b for a, b in zip(drops, drops[1:]))
    table = RateTable({"m": (100.0, 150.0)})
    alone = Instance(table, {"m": 3}, Cluster(1, 2), images_per_epoch=300, checkpoint_seconds=1.0)
    assert lower_bound(alone) == pytest.approx(3 * 300 / 150 + 1.0) == simulate(alone, FleetE()).end_time
    with pytest.raises(ValueError, match="time_limit_seconds"):
        lower_bound(Instance(table, {"m": 3}, Cluster(1, 2), 300, time_limit_seconds=10.0))


def test_fleet_e_beats_the_baseline_by_the_papers_least_speedup_in_the_paper_like_setting():
    """scripts/simulate_fleet.py (b), one ensemble at the smallest and largest cluster; the docs give all."""
    for slots in (20, 160):
        cluster = Cluster(slots // 4, 4, cores_per_node=20, prep_seconds_per_image=0.05)
        instance = random_instance(random.Random(0), 100, cluster, epochs=(10, 60), checkpoint_seconds=30)
        baseline, elastic = (simulate(instance, policy).end_time for policy in (Baseline(), FleetE()))
        assert baseline / elastic >= 1.12
        assert elastic <= simulate(instance, FleetL()).end_time


# ---------------------------------------------------------------- topology

def test_the_scheduler_chooses_the_topology_from_its_cluster_model():
    table = RateTable({"a": (100.0, 190.0), "b": (90.0, 170.0), "slow": (30.0, 55.0)})
    # 2 nodes of 2 slots, 2 cores each at 0.01 core-s/image: 100 images/s per slot
    cluster = Cluster(2, 2, cores_per_node=2, prep_seconds_per_image=0.01)
    one_node = {"a": (0,), "b": (0,)}
    assert choose_topology(one_node, table, cluster)[0] == Topology.single_broadcast
    # a on node 0's 2 slots (190 images/s), b on node 1's (170): the producer (node 0: 200 images/s) keeps up
    assert choose_topology({"a": (0, 0), "b": (1, 1)}, table, cluster)[0] == Topology.single_broadcast
    # at 0.02 core-s/image node 0 makes 100 images/s, the flotilla takes 170: every node makes a share
    scarce = Cluster(2, 2, cores_per_node=2, prep_seconds_per_image=0.02)
    topology, why = choose_topology({"a": (0, 0), "b": (1, 1)}, table, scarce)
    assert topology == Topology.all_shared and "every node makes a share" in why
    assert stream_rate(("a", "b"), {"a": (0, 0), "b": (1, 1)}, topology, table, scarce) == 170.0
    assert stream_rate(("a", "b"), {"a": (0, 0), "b": (1, 1)}, Topology.single_broadcast, table, scarce) == 100.0
    # the network into node 1 carries 60 images/s: a whole batch per image under a broadcast,
    # half of each under all_shared on 2 nodes
    narrow = Cluster(2, 2, cores_per_node=4, prep_seconds_per_image=0.01, network_images_per_s=60.0)
    assert stream_rate(("a", "b"), {"a": (0, 0), "b": (1, 1)}, Topology.single_broadcast, table, narrow) == 60.0
    assert stream_rate(("a", "b"), {"a": (0, 0), "b": (1, 1)}, Topology.all_shared, table, narrow) == 120.0
    # speeds 3x apart: streams of like speed; a fixed setting is kept
    assert choose_topology({"a": (0,), "slow": (0,)}, table, cluster)[0] == Topology.multi_broadcast
    assert choose_topology(one_node, table, cluster, Topology.duplicated)[0] == Topology.duplicated
    assert split_streams(Topology.multi_broadcast, ["slow", "a", "b"], {"a": 100, "b": 90, "slow": 30}, 2) == (
        ("a", "b"), ("slow",))
    assert split_streams(Topology.duplicated, ["a", "b"], {}, 2) == (("a",), ("b",))


def test_streams_of_a_flotilla_move_at_their_own_pace_in_simulation_and_in_the_decision():
    table = RateTable({"fast": (200.0,), "slow": (50.0,)})
    instance = Instance(table, {"fast": 2, "slow": 2}, Cluster(1, 2), images_per_epoch=1000)
    scheduler = Scheduler(["fast", "slow"], Cluster(1, 2), Homogeneous())  # both at once, one slot each
    (form,) = of(FormFlotilla, started(scheduler, {"fast": (200.0,), "slow": (50.0,)}))
    assert (form.topology, form.streams, form.rate) == (Topology.multi_broadcast, (("fast",), ("slow",)), 50.0)
    bars = {bar.group: bar for bar in simulate(instance, Homogeneous()).bars}
    assert bars["fast"].end == pytest.approx(10.0) and bars["slow"].end == pytest.approx(40.0)  # not 40 and 40
    fixed = Scheduler(["fast", "slow"], Cluster(1, 2), Shared({"fast": 1, "slow": 1}),
                      topology=Topology.single_broadcast)
    (form,) = of(FormFlotilla, fixed.start(0.0))
    assert (form.topology, form.streams, form.why) == (Topology.single_broadcast, (("fast", "slow"),),
                                                       "topology=single_broadcast")
