"""CUDA paths: trainers on GPUs, NCCL for a model on two GPUs. Skipped without CUDA."""
import pytest

from pipeline.run import run
from tests.conftest import compose_config

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_ensemble_trains_on_gpus_with_nccl_for_models_and_hubs(tiny_dataset, tmp_path):
    """With 2+ GPUs: a model on two GPUs (DDP over NCCL) and two simulated nodes whose hubs
    all-gather over NCCL; every trainer still gets exactly what its hubs published."""
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
    stream_of = {m["name"]: m["input"] for m in results["models"]}
    for trainer, received in results["delivery"]["received"].items():
        flotilla, model, _ = trainer.split("/")
        hubs = results["delivery"]["flotillas"][flotilla]["hubs"].values()
        sent = [hub["sent_checksums"][stream_of[model]] for hub in hubs if stream_of[model] in hub["sent_checksums"]]
        assert sent and all(received == s for s in sent)
