"""The project as pip installs it from its wheel (`pip install .`, `pip install git+...`), not from this
checkout: what `python -m pipeline` needs beyond the Python modules (its config tree) must ship in the
wheel, a user's own ensemble file comes in through Hydra's --config-dir, and a user's own stage from the folder
the command runs in."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.test_graph import documented
from tests.test_run import REPO

pytestmark = pytest.mark.slow

SOURCES = ("pyproject.toml", "README.md", "pipeline", "stages", "hydra_plugins")
OWN_ENSEMBLE = """\
# @package _global_
ensemble:
  models:
    - {name: mine_resnet, input: main, model: {_target_: pipeline.training.models.resnet, depth: 10, width: 8}}
    - {name: mine_densenet, input: alt,
       model: {_target_: pipeline.training.models.densenet, depth: 10, growth_rate: 4, width: 8}}
"""  # and configuration.md's own stage, as it wires it in


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True,
                   timeout=300)


def test_the_installed_wheel_runs_the_command_with_a_users_own_ensemble_and_stage(tmp_path):
    """The wheel built from the sources (offline: no build isolation, no index), installed into a folder of
    its own that comes first on the path; the command, run from a folder of the user's, trains a user's
    ensemble file given with --config-dir over the shipped config tree, through the stage configuration.md
    shows, from a module in that folder (Dask's workers import it too). Fails if the wheel lacks the
    config tree (Hydra finds no primary config) or a module, or if the run imports this checkout's code."""
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"), str(source))
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    pip("install", "--no-deps", "--no-index", "--target", str(tmp_path / "site"), str(wheel))
    (tmp_path / "mine" / "ensemble").mkdir(parents=True)
    (tmp_path / "mine" / "ensemble" / "mine.yaml").write_text(OWN_ENSEMBLE + documented("yaml"))
    user = tmp_path / "user"
    user.mkdir()
    (user / "my_stages.py").write_text(documented("python"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    modules = ("pipeline", "stages", "hydra_plugins.pipeline_launcher.shared_launcher")
    where = subprocess.run([sys.executable, "-c", "import importlib, sys\nfor name in sys.argv[1:]: "
                            "print(importlib.import_module(name).__file__)", *modules],
                           cwd=user, env=env, capture_output=True, text=True, timeout=60, check=True)
    site = tmp_path / "site"
    assert where.stdout.split() == [str(site / "pipeline" / "__init__.py"), str(site / "stages" / "__init__.py"),
                                    str(site / "hydra_plugins" / "pipeline_launcher" / "shared_launcher.py")]
    run = subprocess.run(
        [sys.executable, "-m", "pipeline", "--config-dir", str(tmp_path / "mine"), "+ensemble=mine",
         "dataset.synthetic_classes=3", "dataset.synthetic_images_per_class=12", "pipeline.batch_size=16",
         "pipeline.image_size=32", "pipeline.alt_image_size=24", "trainer.epochs=1", "hydra.run.dir=out"],
        cwd=user, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    results = json.loads((user / "out" / "results.json").read_text())
    assert [(m["name"], m["epochs"]) for m in results["models"]] == [("mine_resnet", 1), ("mine_densenet", 1)]
    stages, dataset = results["pipeline"]["stages"], results["dataset"]
    assert stages["bright"]["items"] == stages["crop_main"]["items"] == dataset["train_images"] + dataset["val_images"]
    assert (user / "data").is_dir()  # the stand-in, at dataset.root's default, relative to where it ran
