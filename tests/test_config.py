"""Config composition: the schema catches mistakes with the key's full name."""
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from pipeline.config import (RUN_LOCK, RUN_OUTPUTS, ConfigError, check, check_output_dir, expand_ensemble,
                             release_output_dir)
from tests.conftest import compose_config
from tests.test_run import REPO


def test_demo_and_paper_scale_are_one_override_apart():
    """The paper's ensemble is every model at every rate of its grid, ResNets fed 224 px crops and
    DenseNets 299 px; the demo's models keep their own rates. A grid that leaves a model at its own rate,
    or both branches cropped at one size, fails."""
    paper = compose_config(["+ensemble=caltech256_paper", "ensemble.grid.optimizer.lr=[0.1,0.02]"])
    models = expand_ensemble(paper.ensemble, paper.seed)
    assert [(m.name, m.optimizer["lr"]) for m in models[:4]] == [
        ("resnet10_w32_lr0.1", 0.1), ("resnet10_w32_lr0.02", 0.02), ("resnet18_lr0.1", 0.1), ("resnet18_lr0.02", 0.02)]
    assert len(models) == 5 * 2
    stages = OmegaConf.to_container(paper.pipeline.stages, resolve=True)
    crop = {"main": stages["crop_main"]["size"], "alt": stages["crop_alt"]["size"]}
    assert {(m.model["_target_"].rsplit(".")[-1], crop[m.input]) for m in models} == {("resnet", 224),
                                                                                       ("densenet", 299)}
    demo = expand_ensemble(compose_config(["+ensemble=caltech256"]).ensemble, 0)
    assert [(m.name, m.optimizer["lr"]) for m in demo[:2]] == [("resnet10_w16", 0.1), ("resnet10_w24", 0.05)]


def test_members_take_the_ensembles_optimizer_under_their_own_keys():
    """The shipped default is today's training (Nesterov SGD, momentum 0.9, wd 5e-4, cosine, cross-entropy);
    a member's keys go over the ensemble's; a member naming another _target_ replaces it whole (AdamW
    given SGD's momentum would fail); optimizer@ensemble.optimizer=adamw swaps every member's."""
    members = expand_ensemble(compose_config(["+ensemble=caltech256", "+ensemble.models.1.optimizer._target_="
                                              "torch.optim.AdamW", "+ensemble.models.2.loss.label_smoothing=0.1",
                                              "++ensemble.models.3.optimizer.momentum=0.5"]).ensemble, 0)
    assert members[0].optimizer == {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1, "momentum": 0.9,
                                    "weight_decay": 5e-4, "nesterov": True}
    assert members[0].lr_scheduler == {"_target_": "pipeline.training.members.cosine", "_partial_": True,
                                       "warmup_fraction": 0.0}
    assert members[0].loss == {"_target_": "torch.nn.CrossEntropyLoss"}
    assert members[1].optimizer == {"_target_": "torch.optim.AdamW", "lr": 0.05}
    assert members[2].loss == {"_target_": "torch.nn.CrossEntropyLoss", "label_smoothing": 0.1}
    assert members[3].optimizer["momentum"] == 0.5 and members[3].optimizer["nesterov"]
    swapped = expand_ensemble(compose_config(["+ensemble=caltech256", "optimizer@ensemble.optimizer=adamw"]).ensemble,
                              0)
    assert swapped[1].optimizer == {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 0.05,
                                    "weight_decay": 0.01}


def test_each_member_has_its_own_seed_from_the_runs_seed_and_its_name():
    """Members differing only in learning rate start from different weights; the same run starts the same."""
    cfg = compose_config(["+ensemble=caltech256", "++ensemble.grid.optimizer.lr=[0.1,0.2]", "ensemble.models.0.seed=7"])
    seeds = {m.name: m.seed for m in expand_ensemble(cfg.ensemble, 0)}
    assert seeds["resnet10_w16_lr0.1"] == seeds["resnet10_w16_lr0.2"] == 7
    others = [seed for name, seed in seeds.items() if not name.startswith("resnet10_w16")]
    assert len(set(others)) == len(others) == 6
    assert {m.name: m.seed for m in expand_ensemble(cfg.ensemble, 0)} == seeds
    assert {m.name: m.seed for m in expand_ensemble(cfg.ensemble, 1)}["resnet10_w24_lr0.1"] != seeds[
        "resnet10_w24_lr0.1"]


def test_a_grid_expands_every_member_that_has_its_keys():
    """Two keys: every combination, named by them; model.growth_rate only where the model takes it."""
    cfg = compose_config(["+ensemble=caltech256", "++ensemble.grid.optimizer.weight_decay=[0,1e-4]",
                          "++ensemble.grid.model.growth_rate=[8,16]"])
    members = expand_ensemble(cfg.ensemble, 0)
    assert [m.name for m in members[:2]] == ["resnet10_w16_weight_decay0", "resnet10_w16_weight_decay0.0001"]
    dense = [(m.name, m.optimizer["weight_decay"], m.model["growth_rate"]) for m in members if "k12" in m.name]
    assert dense == [("densenet40_k12_weight_decay0_growth_rate8", 0, 8),
                     ("densenet40_k12_weight_decay0_growth_rate16", 0, 16),
                     ("densenet40_k12_weight_decay0.0001_growth_rate8", 1e-4, 8),
                     ("densenet40_k12_weight_decay0.0001_growth_rate16", 1e-4, 16)]
    assert len(members) == 2 * 2 + 2 * 4


@pytest.mark.parametrize("override, message", [
    ("+ensemble.grid.optimizer.betas=[[0.9,0.99]]", "ensemble.grid.optimizer.betas: no member has the key"),
    ("+ensemble.grid.optimizer.lr=0.1", "ensemble.grid.optimizer.lr=0.1: give a list of values"),
    ("ensemble.models.0.model=resnet", "ensemble.models[0] (resnet10_w16).model='resnet': give a dict with a "
                                       "_target_"),
    ("ensemble.optimizer=null", "ensemble.optimizer=None: give a dict with a _target_ (pipeline/conf/optimizer/ has "
                                "presets)"),
])
def test_a_declaration_the_schema_lets_through_is_one_config_error(override, message):
    with pytest.raises(ConfigError) as err:
        cfg = compose_config(["+ensemble=caltech256", override])
        expand_ensemble(cfg.ensemble, 0)
    assert message in str(err.value)


def test_misspelt_key_is_refused_with_its_full_name():
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["+ensemble=caltech256", "trainer.epoch=3"])
    assert "trainer.epoch" in str(err.value.__cause__ or err.value)


def test_wrong_type_is_refused():
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        compose_config(["+ensemble=caltech256", "trainer.epochs=many"])
    assert "trainer.epochs" in str(err.value.__cause__ or err.value)


def test_model_fields_are_checked_against_the_schema():
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        compose_config(["+ensemble=caltech256", "ensemble.models.0.slots=many"])
    assert "ensemble.models[0].slots" in str(err.value.__cause__ or err.value)


def test_duplicate_model_names_are_refused():
    cfg = compose_config(["+ensemble=caltech256", "ensemble.models.1.name=resnet10_w16"])
    with pytest.raises(ValueError, match="'resnet10_w16' is used twice"):
        expand_ensemble(cfg.ensemble, cfg.seed)


@pytest.mark.parametrize("override, key, allowed", [
    ("mode=benchmark", "mode", "train, profile"),
    ("topology=ring", "topology", "auto, single_broadcast, all_shared, multi_broadcast, duplicated"),
    ("on_error=ignore", "on_error", "skip, fail"),
    ("trainer.device=tpu", "trainer.device", "auto, cuda, cpu"),
    ("pipeline.decode_backend=turbo", "pipeline.decode_backend", "simplejpeg, pillow, dali"),
    ("scheduler.policy=fleet", "scheduler.policy", "shared, fleet_e, fleet_g, fleet_l, baseline, homogeneous"),
    ("dataset.synthetic=sometimes", "dataset.synthetic", "auto, never"),
])
def test_a_value_outside_its_choices_is_refused_naming_the_key_and_the_choices(override, key, allowed):
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        compose_config(["+ensemble=caltech256", override])
    message = str(err.value.__cause__ or err.value)
    assert f"full_key: {key}" in message and f"expected one of [{allowed}]" in message


@pytest.mark.parametrize("override, message", [
    ("cluster.workers=0", "cluster.workers=0: give a positive integer or 'auto'"),
    ("cluster.in_flight=many", "cluster.in_flight='many': give a positive integer or 'auto'"),
    ("trainer.slots=-2", "trainer.slots=-2: give a positive integer or 'auto'"),
    ("pipeline.batch_size=1", "pipeline.batch_size=1: a training step needs at least 2 images"),
    ("delivery.ring_depth=1", "delivery.ring_depth=1: one batch is being read while the next is written"),
    ("timeouts.report_s=0", "timeouts.report_s=0.0: a wait must be positive seconds"),
    ("timeouts.collective_s=-1", "timeouts.collective_s=-1.0: a wait must be positive seconds"),
    ("timeouts.warn_s=700", "timeouts.warn_s=700.0 is not below timeouts.stall_s=600.0: a wait says what it waits "
                            "for before it fails; lower warn_s"),
    ("scheduler.min_active_fraction=1.5", "scheduler.min_active_fraction=1.5: give a fraction in [0, 1]"),
    ("scheduler.halving.eta=1", "scheduler.halving.eta=1: give 2 or more (the best 1/eta of a rung's members go on)"),
    ("scheduler.halving.eta=-2", "scheduler.halving.eta=-2: give 2 or more"),
    ("scheduler.halving.min_epochs=0", "scheduler.halving.min_epochs=0: the first rung comes after at least one"),
    ("scheduler.target_accuracy=90", "scheduler.target_accuracy=90.0: give the share of validation images right, "
                                     "in (0, 1] (e.g. 0.9 for 90%)"),  # as a percent: no model would ever reach it
    ("scheduler.patience=-1", "scheduler.patience=-1: give the epochs without a gain"),  # crashed after an epoch
    ("scheduler.min_delta=-0.01", "scheduler.min_delta=-0.01: give the smallest gain"),
])
def test_values_the_types_let_through_are_checked_once_before_a_run(override, message):
    with pytest.raises(ConfigError) as err:
        check(compose_config(["+ensemble=caltech256", override]))
    assert message in str(err.value)


def test_halving_off_or_by_two_or_more_passes_the_check():
    for eta in (0, 2, 3):
        check(compose_config(["+ensemble=caltech256", f"scheduler.halving.eta={eta}"]))


def test_auto_or_a_count_keeps_its_type():
    cfg = compose_config(["+ensemble=caltech256", "cluster.workers=3", "trainer.slots=auto"])
    check(cfg)
    assert cfg.cluster.workers == 3 and isinstance(cfg.cluster.workers, int) and cfg.trainer.slots == "auto"
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        compose_config(["+ensemble=caltech256", "cluster.workers=2.5"])
    assert "cluster.workers" in str(err.value.__cause__ or err.value)


def test_help_names_the_command_as_users_type_it_and_says_what_it_does():
    """`python -m pipeline --help` names the app `pipeline` (Hydra would say `__main__`), the name each run's
    log file takes too (pipeline.log); it says what the command does and how it is typed, then lists Hydra's
    groups and the config, and ends with where every key and exit code is documented."""
    shown = subprocess.run([sys.executable, "-m", "pipeline", "--help"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    text = shown.stdout
    assert shown.returncode == 0 and text.startswith("pipeline: trains an ensemble of DNNs"), text[:300]
    assert "  python -m pipeline +ensemble=caltech256 " in text and "== Configuration groups ==" in text
    assert "scheduler: baseline, fleet_e" in text and "\ntrainer:\n" in text  # Hydra's own sections
    assert text.rstrip().endswith("Hydra's own options: --hydra-help."), text[-300:]


def test_a_fresh_run_refuses_a_folder_that_holds_an_earlier_runs_outputs(tmp_path):
    """A run into an earlier run's folder would overwrite its results and mix their checkpoints (the older
    run's best one kept as the new run's, the new run's own pruned as older). Hydra's files, as a run that
    failed before training leaves, are no run; resume= continues the run there."""
    (tmp_path / "failed early" / ".hydra").mkdir(parents=True)
    check_output_dir(tmp_path / "failed early", fresh=True)
    check_output_dir(tmp_path / "new", fresh=True)  # made
    for name in RUN_OUTPUTS:
        folder = tmp_path / name
        (folder / name).mkdir(parents=True)
        with pytest.raises(ConfigError, match=rf"{folder} holds an earlier run \({name}\): give this run a folder "
                                              r"of its own \(hydra.run.dir.*resume="):
            check_output_dir(folder, fresh=True)
        check_output_dir(folder, fresh=False)


def test_the_command_refuses_an_earlier_runs_folder_before_hydra_writes_its_files_there(tmp_path):
    """`hydra.run.dir` fixed, a second run: one line, exit 2, and the earlier run's .hydra files as they were."""
    earlier = tmp_path / "run"
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / ".hydra" / "config.yaml").write_text("the earlier run's\n")
    (earlier / "results.json").write_text("{}")
    refused = subprocess.run([sys.executable, "-m", "pipeline", "+ensemble=caltech256", f"hydra.run.dir={earlier}"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip() == (f"error: {earlier} holds an earlier run (results.json): give this run a "
                                      "folder of its own (hydra.run.dir, or hydra.sweep.dir for -m), remove that "
                                      f"one to train there anew, or continue a stopped run with resume={earlier}")
    assert (earlier / ".hydra" / "config.yaml").read_text() == "the earlier run's\n"


HOLD_FOLDER = """import sys
from pathlib import Path
from pipeline.config import check_output_dir
check_output_dir(Path(sys.argv[1]), fresh=True)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_folder_another_run_writes_to_now_is_refused_until_that_run_ends(tmp_path):
    """Two runs started in the same second get Hydra's same default folder, and resume= may name a run still
    going: both would write the same results and checkpoints. The first holds its folder (a lock that its end,
    however it ends, lets go): the second stops at once, exit 2, naming the holder's pid, before Hydra writes its
    files there."""
    folder = tmp_path / "outputs" / "2026-11-29" / "03-40-00"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_FOLDER, str(folder)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "config.yaml").write_text("the first run's\n")
        refused = subprocess.run([sys.executable, "-m", "pipeline", "+ensemble=caltech256", f"hydra.run.dir={folder}"],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert refused.stderr.strip() == (f"error: {folder} is the folder of a run going on now (pid {holder.pid}): "
                                          "give each run a folder of its own (hydra.run.dir, or hydra.sweep.dir for "
                                          "-m; runs started in the same second get the same default one), or wait "
                                          "for that run to end")
        assert (folder / ".hydra" / "config.yaml").read_text() == "the first run's\n"
    finally:
        holder.kill()
        holder.wait()
    check_output_dir(folder, fresh=True)  # its holder killed: the kernel let go of the lock
    release_output_dir(folder)


def test_a_run_removes_its_lock_file_as_it_ends_and_a_lock_taken_on_a_removed_one_holds_nothing(tmp_path,
                                                                                                monkeypatch):
    """A folder keeps only what its runs made: the lock file goes as its run ends. A second run that opened
    it just before (it was refused while the first ran) and locks it just after holds a file no longer in
    the folder: it must take the folder's file as it is now, which a third run is then refused. Taken on the
    removed file, two runs would write one folder."""
    import fcntl

    from pipeline import config

    folder = tmp_path / "run"
    check_output_dir(folder, fresh=True)
    assert (folder / RUN_LOCK).read_text() == f"{os.getpid()}\n"
    release_output_dir(folder)
    assert not (folder / RUN_LOCK).exists()
    check_output_dir(folder, fresh=True)  # the first run, again
    flock, locked = fcntl.flock, []

    def the_first_run_ends_between_the_open_and_the_lock(file, how):
        if not locked:
            release_output_dir(folder)
        locked.append(file.name)
        return flock(file, how)

    monkeypatch.setattr(config.fcntl, "flock", the_first_run_ends_between_the_open_and_the_lock)
    second = config._lock_folder(folder.resolve())
    monkeypatch.undo()
    assert len(locked) == 2  # the removed file, then the folder's
    assert (folder / RUN_LOCK).read_text() == f"{os.getpid()}\n"
    with pytest.raises(ConfigError, match="is the folder of a run going on now"):
        config._lock_folder(folder.resolve())
    second.close()
    # On NFS a lock taken on a file removed meanwhile fails ESTALE: that one is tried again; a filesystem
    # that takes no locks at all (ENOLCK) runs unlocked.
    for errno_, held in ((errno.ESTALE, True), (errno.ENOLCK, False)):
        failed = []

        def fails_once(file, how):
            if not failed:
                failed.append(file.name)
                raise OSError(errno_, os.strerror(errno_))
            return flock(file, how)

        monkeypatch.setattr(config.fcntl, "flock", fails_once)
        lock = config._lock_folder(folder.resolve())
        monkeypatch.undo()
        assert (lock is not None) == held, errno_
        if lock:
            lock.close()


def test_a_job_in_its_own_folder_reads_relative_files_from_where_the_command_ran(tmp_path, monkeypatch):
    """Under hydra.job.chdir=true a job runs in its own folder: the dataset, the TLS files, the agents' secret
    and a local MLflow store named relative to where the command ran are still found there (not looked for,
    or made anew for each job, in the job's folder). The dataset's was not: its stage read dataset.root from
    the job's folder, and a run with a relative root stopped ("dataset root data does not exist")."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from pipeline.data.executor import TlsFiles
    from pipeline.measure.tracking import launch_relative
    from pipeline.orchestration.agent import agent_key
    from pipeline.data.dataset import prepare_dataset
    from pipeline.run import _graph

    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("PEM")
    (tmp_path / "agent.key").write_text("k" * 32)
    (tmp_path / "agent.key").chmod(0o600)
    for label in ("a", "b"):  # (the graph lists files; nothing reads them here)
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(4):
            (tmp_path / "data" / label / f"{i}.jpg").touch()
    cfg = compose_config(["+ensemble=caltech256", "cluster.address=tls://10.0.0.1:8786", "cluster.tls.ca_file=ca.pem",
                          "cluster.tls.cert=cert.pem", "cluster.tls.key=key.pem", "dataset.root=data"],
                         with_hydra=True)
    with open_dict(cfg):
        cfg.hydra.runtime.cwd = str(tmp_path)
    (tmp_path / "multirun" / "0").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "multirun" / "0")
    held = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)
    try:
        check(cfg)
        d = cfg.dataset  # as prepare_inputs finds the dataset and builds its graph
        dataset = prepare_dataset(d.root, d.synthetic, d.synthetic_classes, d.synthetic_images_per_class,
                                  d.synthetic_difficulty)
        source = _graph(cfg, expand_ensemble(cfg.ensemble, cfg.seed), dataset.root).source
        folders = {Path(path).parent.parent for path, _ in source.files["train"]}
        assert not dataset.synthetic and source.class_names == ["a", "b"] and folders == {tmp_path / "data"}
        assert cfg.dataset.root == "data"  # as the user gave it: results.json and resume= compare it
        assert TlsFiles.configured(cfg.cluster.tls) == TlsFiles(*(str(tmp_path / n) for n in ("ca.pem", "cert.pem",
                                                                                                "key.pem")))
        assert agent_key("agent.key", "cluster.agent_key_file") == b"k" * 32
        relative = ("file:./mlruns", "mlruns", "sqlite:///runs/mlflow.db?timeout=20")
        assert [launch_relative(uri) for uri in relative] == [(tmp_path / "mlruns").as_uri()] * 2 + [
            f"sqlite:///{tmp_path}/runs/mlflow.db?timeout=20"]
        kept = ("file:///srv/mlruns", "sqlite:////srv/mlflow.db", "sqlite:///:memory:", "http://10.0.0.1:5000",
                "databricks")
        assert [launch_relative(uri) for uri in kept] == list(kept)
    finally:
        HydraConfig.instance().cfg = held
