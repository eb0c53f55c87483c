"""Device slots: simulated nodes share this machine's GPUs; real hosts (node agents) have their own."""
import pytest

from pipeline.orchestration.devices import SlotError, slot_devices
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
