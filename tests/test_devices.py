"""Device slots: simulated nodes share this machine's GPUs; real hosts (node agents) have their own."""
import os

import pytest

from pipeline.orchestration.devices import (CUDA_CONTEXT_BYTES, SlotError, most_sub_slots, slot_devices,
                                           slot_memory_bytes, trainer_threads)
from tests.conftest import member

MODEL = member("m")


def test_simulated_nodes_split_this_machines_gpus():
    slots = slot_devices("cuda", 4, "auto", [MODEL], nodes=2)
    assert [(s.node, d) for s, d in slots.items()] == [(0, "cuda:0"), (0, "cuda:1"), (1, "cuda:2"),
                                                              (1, "cuda:3")]


def test_each_real_host_numbers_its_own_gpus():
    slots = slot_devices("cuda", 2, "auto", [MODEL], nodes=2, hosts=True)
    assert [(s.node, d) for s, d in slots.items()] == [(0, "cuda:0"), (0, "cuda:1"), (1, "cuda:0"),
                                                              (1, "cuda:1")]


def test_more_slots_than_the_hosts_gpus_is_refused():
    with pytest.raises(SlotError, match=r"trainer.slots=6 but the hosts have 4 GPU\(s\)"):
        slot_devices("cuda", 2, 6, [MODEL], nodes=2, hosts=True)


def test_a_gpu_split_into_sub_slots_gives_each_slot_its_share():
    """trainer.slots_per_device=3 on 2 GPUs: 6 slots taking the GPUs in turn (3 models spread over both, not
    3 on one), each with a third of its GPU less a CUDA context. On real hosts each numbers its own GPUs.
    On CPU it leaves the slots as asked (it splits their threads). Slots numbered by GPU first, or a share
    that forgets the context, fails."""
    slots = slot_devices("cuda", 2, "auto", [MODEL], per_device=3)
    assert list(slots.values()) == ["cuda:0", "cuda:1"] * 3
    hosts = slot_devices("cuda", 1, "auto", [MODEL], nodes=2, hosts=True, per_device=2)
    assert [(s.node, d) for s, d in hosts.items()] == [(0, "cuda:0"), (0, "cuda:0"), (1, "cuda:0"), (1, "cuda:0")]
    assert list(slot_devices("cpu", 0, 2, [MODEL], per_device=3).values()) == ["cpu", "cpu"]
    assert slot_memory_bytes("cuda", 6, None, 24 * 2**30, 3) == 8 * 2**30 - CUDA_CONTEXT_BYTES
    assert slot_memory_bytes("cuda", 2, None, 24 * 2**30, 1) == 24 * 2**30


def test_sub_slots_refuse_more_slots_than_they_have_and_data_parallel_models():
    """A sub-slot holds one rank (NCCL takes one per GPU): a model asking for 2 slots is refused, naming it
    and both fixes; so are more slots than the GPUs' sub-slots."""
    with pytest.raises(SlotError, match=r"trainer.slots=5 but this machine has 2 GPU\(s\) of 2 slots "
                                        r"\(trainer.slots_per_device\); lower trainer.slots"):
        slot_devices("cuda", 2, 5, [MODEL], per_device=2)
    with pytest.raises(SlotError, match=r"ensemble.models\[1\].slots=2 \(wide\): a model trains data-parallel on "
                                        r"whole devices .* set its slots to 1 or trainer.slots_per_device=1"):
        slot_devices("cuda", 2, "auto", [MODEL, member("wide", slots=2)], per_device=2)


def test_a_cpu_slots_sub_slots_split_its_threads(monkeypatch):
    """On CPU every slot is a process already: trainer.slots_per_device=n leaves the slots as asked and splits
    trainer.threads among n (one each at least); a GPU's sub-slots keep theirs. grouping=auto tries at most
    one process per thread of a CPU slot, and on a host of 16 cores with 2 GPUs 4 per GPU (one per two cores,
    the others preprocess)."""
    assert list(slot_devices("cpu", 0, 4, [MODEL], per_device=2).values()) == ["cpu"] * 4
    assert [trainer_threads("cpu", 4, n) for n in (1, 2, 3, 8)] == [4, 2, 1, 1]
    assert trainer_threads("cuda", 4, 4) == 4
    assert most_sub_slots("cpu", 3, 1) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert most_sub_slots("cuda", 1, 2) == 4
