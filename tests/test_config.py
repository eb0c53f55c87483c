"""Config composition: the schema catches mistakes with the key's full name."""
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from pipeline.run import expand_ensemble
from tests.conftest import compose_config


def test_demo_and_paper_scale_are_one_override_apart():
    demo = compose_config(["+ensemble=caltech256"])
    paper = compose_config(["+ensemble=caltech256_paper"])
    assert len(expand_ensemble(demo.ensemble)) == 4
    models = expand_ensemble(paper.ensemble)
    assert len(models) == 100 and len({m.name for m in models}) == 100
    assert (paper.pipeline.image_size, paper.pipeline.alt_image_size) == (224, 299)
    assert {m.input for m in models} == {"main", "alt"}


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
