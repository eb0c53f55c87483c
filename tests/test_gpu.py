"""CUDA paths, from one GPU up: trainers on GPUs (groups when the models outnumber them), NCCL for a
model on two GPUs and between hubs, and models that learn in bf16. Skipped without CUDA."""
import pytest

from pipeline.run import run
from tests.conftest import compose_config

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_ensemble_trains_on_gpus_with_nccl_for_models_and_hubs(tiny_dataset, tmp_path):
    """Every GPU in use. With 2+: a model on two GPUs (DDP over NCCL) and two simulated nodes whose hubs
    all-gather over NCCL; with fewer GPUs than models, groups share them. Every trainer still gets
    exactly what its hubs published, stream by stream."""
    import torch

    gpus = torch.cuda.device_count()
    nodes = 2 if gpus >= 2 and gpus % 2 == 0 else 1
    overrides = ["+ensemble=caltech256", f"dataset.root={tiny_dataset}", "dataset.synthetic=never",
                 "pipeline.batch_size=16", "trainer.epochs=1", "trainer.device=cuda", "trainer.record_checksums=true",
                 f"ensemble.models.0.slots={min(gpus // nodes, 2)}", f"cluster.nodes={nodes}", "cluster.workers=2",
                 "topology=all_shared"]
    results = run(compose_config(overrides), tmp_path)
    assert results["devices"]["kind"] == "cuda"
    assert all(d.startswith("cuda:") for m in results["models"] for d in m["devices"])
    for trainer, received in results["delivery"]["received"].items():
        flotilla, _, _, stream = trainer.split("/")
        hubs = results["delivery"]["flotillas"][flotilla]["hubs"].values()
        sent = [hub["sent_checksums"][stream] for hub in hubs if stream in hub["sent_checksums"]]
        assert sent and all(received == s for s in sent)
    assert all(m["epochs"] == 1 for m in results["models"])


def test_alone_fused_and_packed_models_learn_in_bf16_on_a_gpu(tmp_path_factory):
    from pipeline.data.synthetic import generate_imagefolder
    from tests.test_run import GROUPED

    root = tmp_path_factory.mktemp("data") / "learnable"
    generate_imagefolder(root, num_classes=4, images_per_class=40, seed=5, image_size=(60, 80), val_per_class=None)
    results = run(compose_config(["+ensemble=caltech256", f"ensemble.models={GROUPED}", f"dataset.root={root}",
                                  "dataset.synthetic=never", "pipeline.batch_size=16", "pipeline.image_size=32",
                                  "pipeline.alt_image_size=24", "trainer.epochs=5", "scheduler.patience=0",
                                  "trainer.slots=1", "trainer.device=cuda", "trainer.precision=bf16",
                                  "trainer.grouping=fuse", "cluster.workers=2"]), tmp_path_factory.mktemp("out"))
    assert [g["mode"] for g in results["groups"].values()] == ["fused+packed"]
    for model in results["models"]:
        assert max(model["val_accuracy"]) >= 0.75, (model["name"], model["val_accuracy"])  # chance: 25%
