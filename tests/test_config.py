"""Config composition: the schema catches mistakes with the key's full name."""
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from pipeline.config import ConfigError, check, expand_ensemble
from tests.conftest import compose_config


def test_demo_and_paper_scale_are_one_override_apart():
    """The paper's ensemble is every model at every rate of its lr_sweep, ResNets fed 224 px crops and
    DenseNets 299 px; the demo's models keep their own rates. A sweep that leaves a model at its own rate,
    or both branches cropped at one size, fails."""
    paper = compose_config(["+ensemble=caltech256_paper", "ensemble.lr_sweep=[0.1,0.02]"])
    models = expand_ensemble(paper.ensemble)
    assert [(m.name, m.lr) for m in models[:4]] == [("resnet10_w32_lr0.1", 0.1), ("resnet10_w32_lr0.02", 0.02),
                                                    ("resnet18_lr0.1", 0.1), ("resnet18_lr0.02", 0.02)]
    assert len(models) == 5 * 2
    stages = OmegaConf.to_container(paper.pipeline.stages, resolve=True)
    crop = {"main": stages["crop_main"]["size"], "alt": stages["crop_alt"]["size"]}
    assert {(m.arch, crop[m.input]) for m in models} == {("resnet", 224), ("densenet", 299)}
    demo = expand_ensemble(compose_config(["+ensemble=caltech256"]).ensemble)
    assert [(m.name, m.lr) for m in demo[:2]] == [("resnet10_w16", 0.1), ("resnet10_w24", 0.05)]


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
        compose_config(["+ensemble=caltech256", "ensemble.models.0.depth=deep"])
    assert "ensemble.models[0].depth" in str(err.value.__cause__ or err.value)


def test_duplicate_model_names_are_refused():
    cfg = compose_config(["+ensemble=caltech256", "ensemble.models.1.name=resnet10_w16"])
    with pytest.raises(ValueError, match="'resnet10_w16' is used twice"):
        expand_ensemble(cfg.ensemble)


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
])
def test_values_the_types_let_through_are_checked_once_before_a_run(override, message):
    with pytest.raises(ConfigError) as err:
        check(compose_config(["+ensemble=caltech256", override]))
    assert message in str(err.value)


def test_auto_or_a_count_keeps_its_type():
    cfg = compose_config(["+ensemble=caltech256", "cluster.workers=3", "trainer.slots=auto"])
    check(cfg)
    assert cfg.cluster.workers == 3 and isinstance(cfg.cluster.workers, int) and cfg.trainer.slots == "auto"
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        compose_config(["+ensemble=caltech256", "cluster.workers=2.5"])
    assert "cluster.workers" in str(err.value.__cause__ or err.value)
