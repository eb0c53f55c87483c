"""The main job end to end on CPU slots: Dask workers, trainer processes,
shared-memory streams, DDP over gloo, results; and its errors."""
import json
import math
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest

from pipeline.data.dataset import DatasetError, prepare_dataset
from pipeline.orchestration.devices import SlotError
from pipeline.run import ConfigError, run
from stages.base import BadFileError
from tests.conftest import compose_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def small(root, *extra):
    return ["+ensemble=caltech256", f"dataset.root={root}", "dataset.synthetic=never", "pipeline.batch_size=16",
            "pipeline.image_size=32", "pipeline.alt_image_size=24", "cluster.workers=2", *extra]


def shm_segments(pid=None):
    """Shared memory of the project's runs (of process `pid` only, if given)."""
    prefixes = (f"ensemble-{pid}-", f"ensemble-out-{pid}-") if pid else ("ensemble-",)
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefixes)}


@pytest.fixture(scope="module")
def full_run(bad_dataset, tmp_path_factory):
    """Two epochs over a dataset with bad files; one model on 2 slots (DDP)."""
    before = shm_segments(os.getpid())
    out = tmp_path_factory.mktemp("run")
    cfg = compose_config(small(bad_dataset[0], "trainer.epochs=2", "trainer.record_checksums=true",
                               "ensemble.models.0.slots=2"))
    results = run(cfg, out)
    return results, out, bad_dataset[1], before


def sent_on(results, flotilla, stream):
    """What the hubs of a flotilla published on a stream: the same at every hub."""
    hubs = results["delivery"]["flotillas"][flotilla]["hubs"].values()
    sent = [[tuple(s) for s in hub["sent_checksums"][stream]] for hub in hubs if stream in hub["sent_checksums"]]
    assert sent and all(s == sent[0] for s in sent)
    return sent[0]


def test_every_trainer_received_every_batch_once_in_order_bit_identical(full_run):
    results, *_ = full_run
    delivery = results["delivery"]
    trainers = {m["name"]: (m["input"], m["slots"]) for m in results["models"]}
    assert len(delivery["received"]) == sum(slots for _, slots in trainers.values()) == 5
    for trainer, received in delivery["received"].items():
        flotilla, model, _ = trainer.split("/")
        assert [tuple(r) for r in received] == sent_on(results, flotilla, trainers[model][0]), trainer
    batches = [s for s in sent_on(results, "0", "main") if s[0] == 0]
    per_epoch = sum(math.ceil(results["dataset"][f"{split}_images"] / 16) for split in ("train", "val"))
    assert len(batches) == 2 * per_epoch == len({(s[1], s[2], s[3]) for s in batches})


def test_results_report_models_ensemble_stages_and_bad_files(full_run):
    results, out, bad, _ = full_run
    assert json.loads((out / "results.json").read_text())["scheduler"]["flotillas"] == [0]
    for model in results["models"]:
        assert model["epochs"] == len(model["val_accuracy"]) == 2 and model["images_per_s"] > 0
        assert model["converged"] == "reached trainer.epochs=2"
        assert (out / "checkpoints" / model["name"] / "epoch2.pt").is_file()
    assert [m["slots"] for m in results["models"]] == [2, 1, 1, 1]
    assert len(results["ensemble"]["val_accuracy"]) == 2
    assert results["ensemble"]["final_val_accuracy"] == results["ensemble"]["val_accuracy"][-1]
    assert set(results["pipeline"]["stages"]) == {"read", "decode", "crop_main", "crop_alt", "main", "alt"}
    assert results["pipeline"]["stages"]["decode"]["cpu_s"] > 0
    skipped = {s["path"] for s in results["skipped"]}
    assert skipped == {str(bad[k]) for k in ("corrupt", "truncated", "empty", "non_image")}
    converted = {c["path"] for c in results["converted"]}
    assert converted == {str(bad[k]) for k in ("grayscale", "cmyk", "png_named_jpg")}


def test_nothing_is_left_behind(full_run):
    *_, before = full_run
    assert shm_segments(os.getpid()) <= before
    import multiprocessing
    assert multiprocessing.active_children() == []


def test_on_error_fail_stops_naming_the_file(bad_dataset, tmp_path):
    cfg = compose_config(small(bad_dataset[0], "trainer.epochs=1", "on_error=fail"))
    with pytest.raises(BadFileError, match=r"001_900\d\.jpg: .*on_error=fail"):
        run(cfg, tmp_path)


@pytest.mark.parametrize("overrides, error, message", [
    (["trainer.slot_memory_gb=0.0001"], SlotError, r"model resnet10_w16 needs about .* GiB per slot"),
    (["ensemble.models.1.slots=3", "trainer.slots=2"], SlotError, r"ensemble.models\[1\].slots=3"),
    (["trainer.device=cuda"], SlotError, "no CUDA device"),
    (["on_error=ignore"], ConfigError, "on_error must be"),
    (["pipeline.stages.crop_alt.inputs=[read]"], ValueError, "pipeline.stages.crop_alt.inputs"),
])
def test_bad_config_is_a_clear_error_before_any_work(tiny_dataset, tmp_path, overrides, error, message):
    if overrides == ["trainer.device=cuda"]:
        pytest.importorskip("torch").cuda.is_available() and pytest.skip("a GPU is present")
    with pytest.raises(error, match=message):
        run(compose_config(small(tiny_dataset, *overrides)), tmp_path)


def test_no_ensemble_chosen(tiny_dataset, tmp_path):
    cfg = compose_config([f"dataset.root={tiny_dataset}"])
    with pytest.raises(ConfigError, match=r"\+ensemble=caltech256"):
        run(cfg, tmp_path)


def test_unwritable_output_directory(tiny_dataset, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot write the run's output directory"):
        run(compose_config(small(tiny_dataset)), blocker / "out")


def test_missing_or_empty_root_without_synthetic_is_an_error(tmp_path):
    for root in (tmp_path / "missing", tmp_path):
        with pytest.raises(DatasetError, match="missing or empty; point dataset.root"):
            prepare_dataset(str(root), "never", 3, 4, 0)


def test_synthetic_stand_in_is_generated_once_and_labelled(tmp_path):
    first = prepare_dataset(str(tmp_path / "c256"), "auto", 3, 4, 0)
    again = prepare_dataset(str(tmp_path / "c256"), "auto", 3, 4, 0)
    assert first.synthetic and first.generated_now and again.synthetic and not again.generated_now
    assert len(list((tmp_path / "c256").glob("*/*.jpg"))) == 12


def test_cli_multirun_runs_each_job_with_its_own_cluster(tmp_path):
    """What a user types: two jobs, synthetic data generated, results written."""
    command = [sys.executable, "-m", "pipeline", "-m", "+ensemble=caltech256", f"dataset.root={tmp_path / 'data'}",
               "dataset.synthetic_classes=3", "dataset.synthetic_images_per_class=12", "pipeline.batch_size=16",
               "pipeline.image_size=32", "pipeline.alt_image_size=24", "trainer.epochs=1", "seed=0,1",
               f"hydra.sweep.dir={tmp_path / 'multirun'}"]
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = job.communicate(timeout=600)  # Popen, not run: the rings are named by the job's pid
    assert job.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "SYNTHETIC stand-in" in stdout and "dataset.root=" in stdout
    assert "trainer.device=cuda" in stdout and "+ensemble=caltech256_paper" in stdout
    jobs = sorted((tmp_path / "multirun").glob("*/results.json"))
    assert len(jobs) == 2
    assert [json.loads(j.read_text())["config"]["seed"] for j in jobs] == [0, 1]
    assert shm_segments(job.pid) == set()  # the jobs' rings (named by the driver's pid) are gone


def test_cli_unwritable_output_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    command = [sys.executable, "-m", "pipeline", "+ensemble=caltech256", f"hydra.run.dir={blocker / 'out'}"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"cannot write the run's output directory {blocker / 'out'}" in done.stderr
    assert "set hydra.run.dir" in done.stderr


def test_fleet_g_trains_flotillas_in_sequence_on_cpu_slots(tiny_dataset, tmp_path):
    """The FLEET scheduler in a real run: profile, then flotillas in turn on 2 CPU slots."""
    cfg = compose_config(small(tiny_dataset, "scheduler=fleet_g", "trainer.slots=2", "trainer.epochs=2",
                               "scheduler.profile_steps=2", "scheduler.profile_warmup=1",
                               f"scheduler.profile_cache={tmp_path / 'profile_cache.json'}"))
    results = run(cfg, tmp_path / "out")
    assert set(results["profile"]) == {m["name"] for m in results["models"]}
    assert all(len(rates) == 2 for rates in results["profile"].values())
    assert (tmp_path / "out" / "profile.json").is_file()
    decisions = results["scheduler"]["decisions"]
    formed = [d for d in decisions if d["decision"] == "FormFlotilla"]
    assert len(formed) >= 2 and len(results["scheduler"]["flotillas"]) == len(formed)
    # fleet_g re-plans on an idle cluster: a flotilla forms only after the previous one's last member left
    for earlier, later in zip(formed, formed[1:]):
        stops = [d["t"] for d in decisions if d["decision"] == "Stop" and d["flotilla"] == earlier["flotilla"]]
        assert stops and max(stops) <= later["t"]
    for model in results["models"]:
        assert model["epochs"] == 2 and model["converged"]
        assert model["flotillas"][0]["start_epoch"] == 0
        assert all(1 <= len(stint["devices"]) <= 2 for stint in model["flotillas"])  # the profile's 1..2 slots


def test_trainer_resumes_from_its_checkpoint(tmp_path):
    import queue

    import torch

    from pipeline.training.trainer import ModelSpec, Trainer, TrainerSpec

    model = ModelSpec("m", "resnet", 10, 8, 12, 0.1, 0.9, 5e-4, 1, "main")
    spec = lambda start: TrainerSpec(model, 3, 32, 4, start, 10, 0, "", "cpu", 1, str(tmp_path), False, False)
    first = Trainer(spec(0), queue.Queue())
    with torch.no_grad():  # weights a fresh model would not have
        for parameter in first.model.parameters():
            parameter.add_(1.0)
    first._checkpoint(accuracy=0.5)
    resumed = Trainer(spec(1), queue.Queue())
    assert resumed.epoch == 1
    for a, b in zip(first.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="cannot resume m after 2 epochs"):
        Trainer(spec(2), queue.Queue())


def test_a_killed_trainer_resumes_from_its_checkpoint(tiny_dataset, tmp_path):
    """Kill one trainer after its first checkpoint: the model leaves its flotilla,
    the scheduler starts it again from that checkpoint, and it finishes."""
    import multiprocessing
    import signal
    import threading

    victim = "densenet40_k8"
    out = tmp_path / "out"

    def kill_after_first_checkpoint():
        while not (out / "checkpoints" / victim / "epoch1.pt").exists():
            time.sleep(0.05)
        time.sleep(0.2)  # its report of epoch 1, sent right after the checkpoint, reaches the driver
        for process in multiprocessing.active_children():
            if process.name == f"trainer-{victim}-0":
                os.kill(process.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    killer.start()
    results = run(compose_config(small(tiny_dataset, "trainer.epochs=3")), out)
    killer.join(timeout=5)
    model = next(m for m in results["models"] if m["name"] == victim)
    assert len(model["failures"]) == 1 and "exited with code -9" in model["failures"][0]
    assert [stint["start_epoch"] for stint in model["flotillas"]] == [0, 1]
    assert model["epochs"] == 3 and model["converged"] == "reached trainer.epochs=3"
    others = [m for m in results["models"] if m["name"] != victim]
    assert all(m["epochs"] == 3 and not m["failures"] for m in others)
