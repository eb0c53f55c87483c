"""Never hang silently: a collective a peer never joins and a trainer that stops taking batches
each end in a HangError that names what was awaited and the timeout's key. (A batch task no worker
can run: tests/test_executor.py.)"""
import multiprocessing as mp
import os
import re
import signal
import time

import numpy as np
import pytest

from pipeline.runtime.hang import HangError
from pipeline.orchestration.flotilla import Flotilla
from pipeline.run import run
from tests.conftest import compose_config, resnet_override
from tests.test_run import shm_segments

pytestmark = pytest.mark.slow
COLLECTIVE_S = 2.0


def _rank(kind, rank, address, imported, stalled, results):
    """Rank 1 joins the process group, then never enters the collective; rank 0 does and reports.
    The ranks meet once all four have imported: the rendezvous has the same 2 s, and on 2 busy cores
    one process's imports can take that much longer than its peer's."""
    import torch

    from pipeline.delivery.collective import StreamLink, init_process_group, make_groups
    from pipeline.training.group import GroupSpec, GroupStep, join_process_group
    from tests.conftest import member

    started = time.monotonic()
    try:
        imported.wait(60)
        if kind == "exchange":  # a stream's hubs (pipeline/delivery/hub.py)
            init_process_group(address, rank, 2, "cpu", COLLECTIVE_S, "the test's hubs")
            shapes = {"main": (4, 4, 3)}
            link = StreamLink(make_groups(((0, 1),), COLLECTIVE_S)[0], (0, 1), shapes, 2, gather=False, device="cpu",
                             timeout_s=COLLECTIVE_S)
            batch = {"main": (np.zeros((2, 4, 4, 3), np.uint8), np.zeros(2, np.int64))}
            step = lambda: link.broadcast(rank, 0, batch)
        else:  # a model on two slots (pipeline/training/trainer.py)
            model = member("m", width=4, weight_decay=0.0, slots=2)
            collectives = join_process_group(address, rank, 2, torch.device("cpu"), COLLECTIVE_S, "m")
            group = GroupStep(GroupSpec("m", (model,)), 2, {"main": 16}, "cpu", 10, world=2)
            batch = {"main": (torch.zeros(2, 3, 16, 16), torch.zeros(2, dtype=torch.int64))}

            def step():
                with collectives():
                    group.train(batch)
        if rank == 1:
            stalled.wait()
            return
        started = time.monotonic()
        step()
        results.put((kind, "completed", 0.0))
    except BaseException as err:
        results.put((kind, f"{type(err).__name__}: {err}", time.monotonic() - started))


def test_a_collective_a_peer_never_joins_fails_naming_it_and_the_timeout_key():
    """Two gloo pairs at once, a hubs' broadcast and a DDP step: the waiting rank fails after
    timeouts.collective_s (2 s here) with a HangError naming the collective and its group."""
    from pipeline.delivery.collective import LocalRendezvous

    rendezvous = LocalRendezvous()
    context = mp.get_context("spawn")
    imported, stalled, results = context.Barrier(4), context.Event(), context.Queue()
    processes = [context.Process(target=_rank, args=(kind, rank, address, imported, stalled, results), daemon=True)
                 for kind, address in (("exchange", rendezvous.next()), ("ddp", rendezvous.next())) for rank in (0, 1)]
    try:
        for process in processes:
            process.start()
        outcome = {kind: (message, waited) for kind, message, waited in (results.get(timeout=60) for _ in range(2))}
    finally:
        stalled.set()
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        rendezvous.close()
    message, waited = outcome["exchange"]
    assert message.startswith("HangError: hub 0's broadcast of batch 0 from hub 0 to the stream's hubs [0, 1] did "
                              "not complete in 2 s (timeouts.collective_s)"), message
    assert COLLECTIVE_S <= waited < COLLECTIVE_S + 5
    message, waited = outcome["ddp"]
    assert message.startswith("HangError: a DDP collective of group m's data-parallel process group (rank 0 of 2) "
                              "did not complete in 2 s (timeouts.collective_s)"), message
    assert COLLECTIVE_S <= waited < COLLECTIVE_S + 5


STALL_S = 8.0


def test_a_trainer_that_stops_taking_batches_fails_the_run_naming_it(tmp_path, monkeypatch, capsys):
    """A real run, one model: its trainer is stopped (SIGSTOP) once it has handed a ring buffer back.
    The hub fills its ring and waits; the driver says so after timeouts.warn_s, then fails within
    timeouts.stall_s naming the trainer, its state, its step and the ring; nothing is left behind."""
    from pipeline.data.synthetic import generate_imagefolder
    from pipeline.delivery.messages import BatchPublished

    root = tmp_path / "data"
    generate_imagefolder(root, num_classes=2, images_per_class=80, seed=1, image_size=(40, 40), val_per_class=None)
    stopped = {}
    progress = Flotilla.hub_progress

    def stop_the_trainer_once_it_consumes(self, timeout):
        events = progress(self, timeout)
        # Batch 2 could only be published into a ring of 2 once the trainer handed batch 0 back.
        if not stopped and any(isinstance(e, BatchPublished) and e.index >= 2 for e in events):
            trainer = next(p for p in mp.active_children() if p.name == "trainer-m-0")
            os.kill(trainer.pid, signal.SIGSTOP)
            stopped.update(pid=trainer.pid, at=time.monotonic())
        return events

    monkeypatch.setattr(Flotilla, "hub_progress", stop_the_trainer_once_it_consumes)
    before = shm_segments(os.getpid())
    cfg = compose_config(["+ensemble=caltech256", f"ensemble.models=[{resnet_override('m', width=4)}]",
                          "~pipeline.stages.alt", "~pipeline.stages.crop_alt", f"dataset.root={root}",
                          "dataset.synthetic=never", "pipeline.batch_size=8",
                          "pipeline.image_size=16", "pipeline.alt_image_size=16", "cluster.workers=1",
                          "trainer.epochs=1", "delivery.ring_depth=2", "timeouts.warn_s=1",
                          f"timeouts.stall_s={STALL_S}", "timeouts.exit_s=2", "timeouts.drain_s=2"])
    try:
        with pytest.raises(HangError) as hang:
            run(cfg, tmp_path / "out")
    finally:
        if stopped:  # a stopped process ignores all but SIGKILL: let it go on, to be killed or exit
            try:
                os.kill(stopped["pid"], signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert stopped, f"the run failed before the trainer was stopped: {hang.value}"
    failed_after = time.monotonic() - stopped["at"]
    # Stopped wherever it was once batch 0 went back: before its first step, inside a step, or between two.
    where = r"before its first step|at step \d+ of \d+ of epoch 1, (in the step of m|between members' steps)"
    assert re.fullmatch(rf"flotilla 0: hub 0 \(node 0\) cannot publish: trainer trainer-m-0 \(pid \d+, stopped, "
                        rf"({where})\) holds all 2 buffers of its ring of sink main\. .* \(nothing moved for \d+ s: "
                        rf"timeouts.stall_s={STALL_S:g}; .*\)", str(hang.value)), str(hang.value)
    assert failed_after < STALL_S + 10, failed_after
    said = capsys.readouterr().out
    assert re.search(r"waiting \d+ s: flotilla 0: hub 0 \(node 0\) cannot publish: trainer trainer-m-0", said), said
    assert mp.active_children() == [] and shm_segments(os.getpid()) <= before
