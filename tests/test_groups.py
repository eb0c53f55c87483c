"""Slot groups: who shares a slot (pure), and the placement of the shipped ensembles on 1-8 GPUs of a
given memory, as a run plans it (no GPU needed: the plan is made before any device is touched)."""
import os
from contextlib import nullcontext
from dataclasses import replace

import pytest
from rich.console import Console

from pipeline import run
from pipeline.orchestration.devices import MEMORY_HEADROOM, SlotError
from pipeline.orchestration.group_plan import ModelSize, group_bytes
from pipeline.scheduler import Cluster, FormFlotilla, RatesMeasured, Scheduler, Start
from pipeline.scheduler.cluster import PlacementError
from pipeline.scheduler.slot_groups import Candidate, Grouping, form_groups
from pipeline.training.group import GroupSpec
from tests.conftest import compose_config, member

H100_BYTES = 80 * 2**30
PREPARED: dict[tuple, run.RunInputs] = {}  # each ensemble's checked members and graph, prepared once (seconds)


def candidate(name, family="r", cost=1.0, slots=1):
    return Candidate(name, slots, family, cost)


def test_models_that_fit_the_slots_stay_alone_and_separate_never_shares():
    models = [candidate(f"m{i}") for i in range(3)]
    assert form_groups(models, 3, Grouping.auto) == [("m0",), ("m1",), ("m2",)]
    assert form_groups(models, 1, Grouping.separate) == [("m0",), ("m1",), ("m2",)]


def test_shared_slots_carry_equal_cost_and_keep_a_family_together():
    """Two families of 4 equal models on 2 slots: one family per slot (they can fuse), not mixed."""
    models = [candidate(f"r{i}", "r") for i in range(4)] + [candidate(f"d{i}", "d") for i in range(4)]
    groups = form_groups(models, 2, Grouping.fuse)
    assert sorted(map(sorted, groups)) == [["d0", "d1", "d2", "d3"], ["r0", "r1", "r2", "r3"]]


def test_unequal_costs_are_balanced():
    models = [candidate("a", "a", 3), candidate("b", "b", 2), candidate("c", "c", 2), candidate("d", "d", 1)]
    loads = sorted(sum({"a": 3, "b": 2, "c": 2, "d": 1}[m] for m in group)
                   for group in form_groups(models, 2, Grouping.pack))
    assert loads == [4, 4]


def test_a_data_parallel_model_keeps_its_slots_and_the_rest_share_what_is_left():
    models = [candidate("ddp", slots=2), *(candidate(f"m{i}", f"f{i}") for i in range(3))]
    groups = form_groups(models, 3, Grouping.pack)
    assert groups[0] == ("ddp",) and sorted(name for g in groups[1:] for name in g) == ["m0", "m1", "m2"]
    assert len(groups) == 2
    with pytest.raises(PlacementError, match="leave none for the other 3"):
        form_groups(models, 2, Grouping.pack)


def spec(name, arch="resnet", width=8, input="main"):
    return member(name, arch=arch, depth=10 if arch == "resnet" else 16, width=width, growth_rate=4, input=input)


def test_a_group_fuses_each_family_in_arrays_and_packs_the_rest():
    group = GroupSpec("g", (spec("a"), spec("b"), spec("c"), spec("w", width=16), spec("d", "densenet")), 2)
    assert [[m.name for m in unit] for unit in group.units()] == [["a", "b"], ["c"], ["w"], ["d"]]
    assert group.mode == "fused+packed" and GroupSpec("g", group.members).mode == "packed"
    assert group.without({"a"}).members == group.members[1:] and group.inputs == ("main",)


def test_a_fused_array_needs_its_members_activations_at_once_packed_members_one_at_a_time():
    """A slot holds every member's state and the activations of what steps at once: the largest unit
    (a fused array: its members' together), or the `lanes` largest side by side; a data-parallel model
    its share of the batch's. Packed members' activations summed, a fused array's taken as its largest
    member's, or a model's share not rounded up, fails."""
    def size(state, activations):
        return ModelSize(0, state, activations, 0.0)

    sizes = {"a": size(100, 1000), "b": size(200, 2000), "c": size(300, 4000), "d": size(400, 2500)}
    members = (spec("a"), spec("b"), spec("c"), spec("d", "densenet"))
    assert group_bytes(GroupSpec("g", members), sizes) == 1000 + 4000
    assert group_bytes(GroupSpec("g", members, 3), sizes) == 1000 + (1000 + 2000 + 4000)
    assert group_bytes(GroupSpec("g", members), sizes, lanes=2) == 1000 + (4000 + 2500)
    data_parallel = replace(spec("a"), slots=2)
    assert group_bytes(GroupSpec("a", (data_parallel,)), {"a": size(100, 1001)}) == 100 + 501


class NodeHost:
    """The node agent whose host has the GPUs (as run.py's agent_rates gives it). It answers every
    measurement with one rate (`pace(group)`, images/s) and records what it was asked: (group, streams)."""

    def __init__(self, pace=lambda group: 100.0):
        self.pace, self.asked = pace, []

    def hardware(self, how):
        from pipeline.training.rates import HostHardware, MeasuredBy

        return HostHardware({"device_name": "H100"}, MeasuredBy("agent", 1))

    def measure(self, group, slot_counts, how):
        from pipeline.training.rates import Measured, MeasuredBy, Pace

        self.asked.append((group.name, group.cuda_streams))
        return Measured({k: Pace(self.pace(group), 0.0) for k in slot_counts}, MeasuredBy("agent", 1))


@pytest.fixture
def plan(monkeypatch, tmp_path, tiny_dataset):
    """The run's own plan (run.plan_training) of a run on one host of `gpus` GPUs of `gpu_bytes`, as that
    host's node agent reports them (`where` measures rates there), made before any device is used; with
    `gpus=None`, of a run on this machine's own devices."""
    def planned(overrides: list[str], gpus: int | None, gpu_bytes: int = H100_BYTES,
                where=None) -> run.TrainingPlan:
        where = where or NodeHost()
        if gpus is not None:
            agent = {"gpus": gpus, "gpu_memory": gpu_bytes, "pid": os.getpid()}
            monkeypatch.setattr(run, "_node_agents", lambda cfg, tls: {0: agent})
            monkeypatch.setattr(run, "agent_key", lambda *args: None)
            monkeypatch.setattr(run, "agent_rates", lambda *args: nullcontext(where))
        cfg = compose_config([*overrides, f"dataset.root={tiny_dataset}", "dataset.synthetic=never",  # as it is
                              f"rates.cache={tmp_path / 'rates.json'}"])
        key = tuple(o for o in overrides if not o.startswith(("trainer.", "scheduler=")))  # what inputs depend on
        if key not in PREPARED:
            PREPARED[key] = run.prepare_inputs(cfg)
        return run.plan_training(cfg, PREPARED[key], tmp_path, Console())
    return planned


@pytest.fixture
def place(plan):
    """The run's plan, then the scheduler's first flotilla: the groups and the slots each was started on."""
    def placed(overrides: list[str], gpus: int, gpu_bytes: int = H100_BYTES):
        planned = plan(overrides, gpus, gpu_bytes)
        # the shared policy needs no rates, fuse and pack none, and the memory of an agent's GPUs is estimated;
        # auto measures a group's CUDA streams (all alike here: it keeps one)
        assert set(planned.measured) <= {"grouping"}, planned.measured
        assert all(set(m) == {"cuda_streams"} for m in planned.measured.get("grouping", {}).values())
        assert all(g.cuda_streams == 1 for g in planned.groups)
        groups = planned.groups
        scheduler = Scheduler([g.name for g in groups], Cluster(nodes=1, slots_per_node=len(planned.slots)),
                              planned.policy)
        starts = [d for d in scheduler.start(0.0) if isinstance(d, Start)]
        assert {d.group for d in starts} == {g.name for g in groups} and {d.flotilla for d in starts} == {0}
        return groups, dict(scheduler.flotillas[0].members)
    return placed


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_the_default_command_is_placed_on_1_to_8_gpus(place, gpus):
    """One group per GPU up to 4 (the models' count), each started on its own. Models sharing a GPU
    while another is idle, a group given two GPUs, or a model left out, fails."""
    groups, placed = place(["+ensemble=caltech256"], gpus)
    members = sorted(m.name for g in groups for m in g.members)
    assert members == ["densenet40_k12", "densenet40_k8", "resnet10_w16", "resnet10_w24"]
    assert len(groups) == min(4, gpus)
    used = [slot for slots in placed.values() for slot in slots]
    assert len(used) == len(set(used)) == len(groups)  # one group per GPU, none shared


def test_one_gpu_split_into_4_sub_slots_trains_each_default_model_in_a_process_of_its_own(plan, place):
    """trainer.slots_per_device=4 on one GPU: the default command's 4 models are 4 groups of one, each on a
    slot of its own, all on cuda:0 (as 4 separate processes would share it). Packing them as on one
    slot, or a slot on a GPU the host lacks, fails."""
    overrides = ["+ensemble=caltech256", "trainer.slots_per_device=4"]
    groups, placed = place(overrides, 1)
    assert sorted(len(g.members) for g in groups) == [1, 1, 1, 1]
    used = [slot for slots in placed.values() for slot in slots]
    assert len(used) == len(set(used)) == 4
    slots = plan(overrides, 1).slots
    assert set(slots.values()) == {"cuda:0"} and len(slots) == 4


def test_auto_trains_a_gpu_groups_units_on_the_streams_measured_fastest(plan):
    """The default command on one GPU (4 models packed): grouping=auto measures the group on 1, 2 and 4 CUDA
    streams, one per unit at most, and keeps the fastest (2 here); its units then step on 2 streams, and the
    results hold each rate. The same run with grouping=pack measures nothing and steps in turn."""
    paces = {1: 100.0, 2: 180.0, 4: 150.0}
    host = NodeHost(lambda group: paces[group.cuda_streams])
    planned = plan(["+ensemble=caltech256"], 1, where=host)
    (group,) = planned.groups
    assert sorted(host.asked) == [(group.name, 1), (group.name, 2), (group.name, 4)]
    assert group.cuda_streams == 2 and group.mode == "packed on 2 streams"
    assert planned.measured["grouping"][group.name]["cuda_streams"] == {"packed": {"1": 100.0, "2": 180.0, "4": 150.0}}
    host = NodeHost(lambda group: paces[group.cuda_streams])
    (packed,) = plan(["+ensemble=caltech256", "trainer.grouping=pack"], 1, where=host).groups
    assert host.asked == [] and packed.cuda_streams == 1


def test_streams_are_tried_only_while_their_units_fit_the_slot_and_packed_on_streams_competes_with_fused(tmp_path):
    """Each stream holds its own unit's activations and workspace. 4 packed units of 1,000 bytes of state,
    1,000 of activations and 500 of workspace fit a slot of 14,000 on 1 or 2 streams (x1.5 headroom: 8,250
    and 10,500) but not on 4 (15,000), which is never measured; the fused way (2 arrays of 2) is measured on
    1 and 2 streams too, and the fastest of all trains: packed on 2 streams here. On CPU, or for a group
    of one model, no stream is tried."""
    from pipeline.orchestration.group_plan import choose_sharing
    from pipeline.training.rates import Measurement

    members = tuple(spec(f"m{i}", width=8 * (1 + i // 2)) for i in range(4))  # 2 families of 2
    sizes = {m.name: ModelSize(params=1, state_bytes=1000, activation_bytes=1000, flops=1, workspace_bytes=500)
             for m in members}
    packed_faster = {(1, 1): 100.0, (1, 2): 190.0, (2, 1): 150.0, (2, 2): 170.0}  # (array size, streams) -> img/s
    host = NodeHost(lambda group: packed_faster[group.array_size, group.cuda_streams])
    how = Measurement(num_classes=4, image_sizes={"main": 32}, batch_size=8, device_kind="cuda",
                      devices=["cuda:0"], steps=1, warmup=0, threads=1, where=host)
    assert group_bytes(GroupSpec("g", members, cuda_streams=4), sizes) * MEMORY_HEADROOM == 15_000
    [group], measured = choose_sharing([GroupSpec("g", members)], Grouping.auto, sizes, 14_000, 1, how,
                                       tmp_path / "rates.json")
    assert (group.array_size, group.cuda_streams, group.mode) == (1, 2, "packed on 2 streams")
    assert sorted(host.asked) == [("g", 1), ("g", 1), ("g", 2), ("g", 2)]
    assert measured == {"g": {"packed": 100.0, "fused": 150.0, "array_size": 2,
                              "cuda_streams": {"packed": {"1": 100.0, "2": 190.0}, "fused": {"1": 150.0, "2": 170.0}}}}
    alone = [GroupSpec("a", members[:1])]
    assert choose_sharing(alone, Grouping.auto, sizes, 14_000, 1, how, tmp_path / "rates.json") == (alone, {})
    on_cpu = replace(how, device_kind="cpu", devices=["cpu"])
    [group], measured = choose_sharing([GroupSpec("g", members)], Grouping.auto, sizes, 14_000, 1, on_cpu,
                                       tmp_path / "cpu_rates.json")
    assert group.cuda_streams == 1 and "cuda_streams" not in measured["g"]


def test_a_sub_slot_holds_its_share_of_the_gpu(place):
    """The paper ensemble's largest model needs 24.5 GiB with headroom: it fits a whole H100, not a
    quarter of one less its CUDA context (19.25 GiB), and the error says the slot's size."""
    place(["+ensemble=caltech256_paper", "trainer.grouping=pack"], 8)
    with pytest.raises(SlotError, match=r"needs about 2\d.\d\d GiB per slot .* but a slot has 19.25 GiB"):
        place(["+ensemble=caltech256_paper", "trainer.slots_per_device=4"], 8)


def test_fleet_measures_models_on_one_sub_slot_of_distinct_gpus(plan):
    """scheduler=fleet_g on 2 GPUs of 2 sub-slots: every model's rate is asked for 1 slot only (a sub-slot
    holds one rank: a model grown data-parallel over two sub-slots of one GPU would fail in NCCL), and on
    the 2 GPUs each once. Rates asked for 2 slots, or a GPU listed twice, fail."""
    from pipeline.training.rates import HostHardware, Measured, MeasuredBy, Pace

    asked = []

    class RecordingHost:
        def hardware(self, how):
            return HostHardware({"device_name": "H100"}, MeasuredBy("agent", 1))

        def measure(self, group, slot_counts, how):
            asked.append((group.name, tuple(slot_counts), tuple(how.devices)))
            return Measured({k: Pace(100.0, 0.0) for k in slot_counts}, MeasuredBy("agent", 1))

    planned = plan(["+ensemble=caltech256", "scheduler=fleet_g", "trainer.slots_per_device=2"], 2,
                   where=RecordingHost())
    assert len(planned.slots) == 4
    names = sorted(m.name for g in planned.groups for m in g.members)
    assert sorted(asked) == [(name, (1,), ("cuda:0", "cuda:1")) for name in names]


@pytest.mark.parametrize("grouping", [Grouping.fuse, Grouping.pack])
def test_the_paper_ensemble_is_placed_on_8_gpus_without_editing_its_config(place, grouping):
    groups, placed = place(["+ensemble=caltech256_paper", f"trainer.grouping={grouping.value}"], 8)
    assert sum(len(g.members) for g in groups) == 100 and len(groups) == len(placed) == 8
    if grouping == Grouping.fuse:  # sweeps fuse: most models train in arrays
        fused = sum(len(unit) for g in groups for unit in g.units() if len(unit) > 1)
        assert fused >= 90, [g.mode for g in groups]
    else:
        assert all(g.mode == "packed" for g in groups)


def test_a_group_too_large_for_a_gpu_is_a_clear_error(place):
    """On one GPU of 32 GiB each paper model fits alone (24.5 GiB at most, headroom included) but the 100
    packed together do not (42 GiB): a plan that skips the group's memory check fails."""
    with pytest.raises(SlotError, match=r"group group0 \(100 models.*trainer.slots"):
        place(["+ensemble=caltech256_paper", "trainer.grouping=pack"], 1, 32 * 2**30)


def test_fleet_plans_groups_at_their_measured_rates(plan, monkeypatch):
    """scheduler=fleet_g with trainer.grouping=pack on 2 slots: every model is measured alone (its cost
    decides who shares), then each group of several on one slot; the planner's members are the groups."""
    from pipeline.training import rates as rate_measurement
    from pipeline.training.rates import Pace

    measured = []

    def fake_measure(group, slot_counts, how, abandon=None):  # the real runs' stand-in: a group is slower per image
        measured.append((tuple(m.name for m in group.members), slot_counts))
        return {k: Pace(100.0 * k / len(group.members), 0.0) for k in slot_counts}

    monkeypatch.setattr(rate_measurement, "measure_rates", fake_measure)
    planned = plan(["+ensemble=caltech256", "scheduler=fleet_g", "trainer.device=cpu", "trainer.slots=2",
                    "trainer.grouping=pack", "pipeline.image_size=32", "pipeline.alt_image_size=24"], None)
    groups, table = planned.groups, planned.table
    assert len(groups) == 2 and all(len(g.members) == 2 and g.mode == "packed" for g in groups)
    assert sorted(measured[:4]) == sorted(((m.name,), [1, 2]) for g in groups for m in g.members)
    assert sorted(measured[4:]) == sorted((tuple(m.name for m in g.members), [1]) for g in groups)
    assert table.rates == {g.name: (50.0,) for g in groups}
    scheduler = Scheduler([g.name for g in groups], Cluster(nodes=1, slots_per_node=2), planned.policy)
    decisions = [d for name, rates in table.rates.items() for d in scheduler.handle(RatesMeasured(0.0, name, rates))]
    formed = [d for d in decisions if isinstance(d, FormFlotilla)]
    assert formed and set(formed[0].members) == {g.name for g in groups}


@pytest.fixture
def timed_side_by_side(monkeypatch):
    """Stand-ins for the measurements grouping=auto makes of a layout (pipeline.orchestration.group_plan):
    one process's group at 100 images/s, n processes side by side at `paces[n]`. Records who was measured
    side by side, and with how many threads each."""
    from pipeline.orchestration import group_plan
    from pipeline.scheduler import RateTable
    from pipeline.training.rates import Pace

    asked, paces = [], {}

    def one_process(groups, max_slots, how, cache):
        table = RateTable()
        for g in groups:
            table.add(g.name, [100.0])
        return table

    def side_by_side(groups, how, cache):
        asked.append(([len(g.members) for g in groups], how.threads))
        return Pace(paces[len(groups)], 0.0)

    monkeypatch.setattr(group_plan, "measure_rate_table", one_process)
    monkeypatch.setattr(group_plan, "measure_side_by_side", side_by_side)
    return asked, paces


CPU_SLOT = ["+ensemble=caltech256", "trainer.device=cpu", "trainer.slots=1", "pipeline.image_size=32",
            "pipeline.alt_image_size=24"]


@pytest.mark.parametrize("threads, paces, chosen", [(2, {2: 150.0}, 2), (2, {2: 90.0}, 1), (4, {2: 150.0, 4: 180.0}, 4),
                                                    (4, {2: 150.0, 4: 120.0}, 2)])
def test_auto_grouping_splits_a_cpu_slot_into_the_sub_slots_measured_fastest(plan, timed_side_by_side, threads,
                                                                             paces, chosen):
    """The default ensemble on one CPU slot of `threads` threads, trainer.grouping=auto: one process packing
    the 4 models (100 images/s) against 2 processes of 2 models, and with 4 threads 4 processes of one, side
    by side, each process with its share of the threads. The fastest layout is the plan: its slots, groups,
    the trainers' threads and the state resume= reads. A layout of more processes than threads, a pace not
    taken from the measurements, or a plan that keeps one slot after choosing more, fails; so does a resumed
    run (its state) that measures again or forgets the layout."""
    asked, measured = timed_side_by_side
    measured.update(paces)
    planned = plan([*CPU_SLOT, f"trainer.threads={threads}"], None)
    assert asked == [([2, 2], threads // 2)] + ([([1, 1, 1, 1], 1)] if threads == 4 else [])
    assert planned.measured["sub_slots"] == {"images_per_s": {"1": 100.0} | {str(n): p for n, p in paces.items()},
                                             "chosen": chosen}
    assert len(planned.slots) == chosen and len(planned.groups) == chosen
    assert sorted(len(g.members) for g in planned.groups) == [4 // chosen] * chosen
    assert planned.setup.threads == threads // chosen
    folder = planned.setup.checkpoint_dir.parent
    resumed = plan([*CPU_SLOT, f"trainer.threads={threads}", f"resume={folder}"], None)  # measures nothing again
    assert len(asked) == (2 if threads == 4 else 1) and len(resumed.slots) == chosen
    assert resumed.groups == planned.groups and resumed.setup.threads == planned.setup.threads


def test_auto_grouping_keeps_one_process_on_a_slot_of_one_thread_and_where_asked(plan, timed_side_by_side):
    """A CPU slot of one thread cannot be split (a process has at least one), nor is a slot whose processes
    trainer.slots_per_device fixes, nor one of trainer.grouping=pack: nothing is measured side by side."""
    asked, _ = timed_side_by_side
    for overrides in (["trainer.threads=1"], ["trainer.threads=2", "trainer.grouping=pack"],
                      ["trainer.threads=2", "trainer.slots=2", "trainer.slots_per_device=2"]):
        planned = plan([*CPU_SLOT, *overrides], None)
        assert "sub_slots" not in planned.measured and asked == []
    assert planned.setup.threads == 1 and len(planned.slots) == 2  # 2 processes sharing a slot's 2 threads
