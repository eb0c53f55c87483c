"""CUDA paths: trainers on GPUs, NCCL for a model on two GPUs. Skipped without CUDA."""
import pytest

from pipeline.run import run
from tests.conftest import compose_config

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_ensemble_trains_on_gpus_with_nccl_for_multi_gpu_models(tiny_dataset, tmp_path):
    import torch

    gpus = torch.cuda.device_count()
    overrides = ["+ensemble=caltech256", f"dataset.root={tiny_dataset}", "dataset.synthetic=never",
                 "pipeline.batch_size=16", "trainer.epochs=1", "trainer.device=cuda", "trainer.record_checksums=true",
                 f"ensemble.models.0.slots={min(gpus, 2)}"]
    results = run(compose_config(overrides), tmp_path)
    assert results["devices"]["kind"] == "cuda"
    assert all(d.startswith("cuda:") for m in results["models"] for d in m["devices"])
    sent = results["delivery"]["sent"]
    stream_of = {m["name"]: m["input"] for m in results["models"]}
    for trainer, received in results["delivery"]["received"].items():
        assert received == sent[stream_of[trainer.split("/")[0]]]
