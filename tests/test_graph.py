"""The stage DAG is built and checked on the driver, before any Dask work."""
import copy

import pytest
from omegaconf import OmegaConf

from pipeline.data.graph import GraphError, build_graph
from stages.base import DataKind
from tests.conftest import compose_config


@pytest.fixture
def stages(tiny_dataset) -> dict:
    cfg = compose_config(["+ensemble=caltech256", f"dataset.root={tiny_dataset}"])
    return OmegaConf.to_container(cfg.pipeline.stages, resolve=True)


def test_default_config_builds_two_branches_from_one_decode_and_its_cache(stages):
    graph = build_graph(stages, {"main", "alt"})
    assert list(graph.stages)[:3] == ["read", "decode", "cache"]
    assert graph.inputs["cache"] == "decode" and graph.cache is graph.stages["cache"]
    assert graph.inputs["crop_main"] == graph.inputs["crop_alt"] == "cache"
    assert graph.sinks["main"].item_shape == (64, 64, 3)
    assert graph.sinks["alt"].item_shape == (48, 48, 3)
    assert graph.specs["decode"].kind is DataKind.IMAGES


def test_decode_is_told_the_detail_its_consumers_need(stages):
    graph = build_graph(stages, {"main", "alt"})
    # scale (0.25, 1): the smallest crop spans half the shorter side -> 2 x 64 px, passed on by the cache
    assert graph.stages["decode"].keep_side == 128


def test_a_cache_after_a_stage_that_may_change_between_epochs_is_refused(stages):
    stages["slow"] = {"_target_": "tests.slow_stage.SlowDown", "inputs": ["decode"]}
    stages["cache"]["inputs"] = ["slow"]
    message = errors_for(stages)
    assert "pipeline.stages.cache.inputs: SlowDown ('slow') may make something else of a file each epoch" in message
    assert "right after decode" in message


def test_a_branch_beside_the_cache_is_refused(stages):
    stages["crop_alt"]["inputs"] = ["decode"]
    message = errors_for(stages)
    assert "pipeline.stages.crop_alt.inputs: 'decode' feeds the cache 'cache'" in message
    assert "take its input from 'cache'" in message


def test_one_cache_at_most(stages):
    stages["cache2"] = {**stages["cache"], "inputs": ["cache"]}
    stages["crop_alt"]["inputs"] = ["cache2"]
    assert "one cache stage at most, found cache, cache2" in errors_for(stages)


def test_a_negative_cache_budget_names_the_key(stages):
    stages["cache"]["budget_gb"] = -1
    message = errors_for(stages)
    assert "pipeline.stages.cache" in message and "budget_gb must be >= 0" in message


def errors_for(stages, consumed={"main", "alt"}):
    with pytest.raises(GraphError) as err:
        build_graph(stages, consumed)
    return str(err.value)


def test_unknown_target_names_key_and_builtins(stages):
    stages["decode"]["_target_"] = "stages.decode.Decoder"
    message = errors_for(stages)
    assert "pipeline.stages.decode._target_" in message and "stages.decode.Decode" in message


def test_target_that_is_not_a_stage(stages):
    stages["decode"]["_target_"] = "pathlib.Path"
    assert "is not a Stage" in errors_for(stages)


def test_missing_target(stages):
    del stages["crop_alt"]["_target_"]
    assert "pipeline.stages.crop_alt has no _target_" in errors_for(stages)


def test_unknown_input_names_the_stages_there_are(stages):
    stages["crop_main"]["inputs"] = ["decoded"]
    message = errors_for(stages)
    assert "pipeline.stages.crop_main.inputs" in message and "'decoded'" in message and "decode" in message


def test_map_stage_without_input(stages):
    del stages["crop_main"]["inputs"]
    assert "takes exactly one input" in errors_for(stages)


def test_cycle_is_reported(stages):
    stages["decode"]["inputs"] = ["crop_main"]
    assert "cycle" in errors_for(stages)


def test_input_kind_mismatch_names_both_kinds(stages):
    stages["crop_main"]["inputs"] = ["read"]
    message = errors_for(stages)
    assert "pipeline.stages.crop_main.inputs" in message
    assert "produces encoded" in message and "accepts images" in message


def test_sink_nobody_consumes(stages):
    message = errors_for(stages, consumed={"main"})
    assert "pipeline.stages.alt is a sink no model reads" in message


def test_model_reading_a_non_sink(stages):
    assert "'crop_main', which is not a sink" in errors_for(stages, consumed={"main", "alt", "crop_main"})


def test_branch_without_sink(stages):
    del stages["alt"]
    assert "pipeline.stages.crop_alt: its output goes nowhere" in errors_for(stages, consumed={"main"})


def test_unknown_field_lists_the_valid_ones(stages):
    stages["crop_main"]["sise"] = 3
    message = errors_for(stages)
    assert "pipeline.stages.crop_main.sise" in message and "size" in message


def test_missing_required_field(stages):
    del stages["crop_main"]["size"]
    assert "pipeline.stages.crop_main" in errors_for(stages)


def test_bad_field_value_names_the_key(stages):
    stages["crop_alt"]["scale"] = [0.5, 0.1]
    message = errors_for(stages)
    assert "pipeline.stages.crop_alt" in message and "scale" in message


def test_second_source_is_refused(stages):
    stages["read2"] = copy.deepcopy(stages["read"])
    stages["decode2"] = {"_target_": "stages.decode.Decode", "inputs": ["read2"]}
    assert "exactly one source" in errors_for(stages)


def test_a_flotilla_reading_one_stream_computes_only_its_branch(stages):
    graph = build_graph(stages, {"main", "alt"}).feeding({"alt"})
    assert list(graph.stages) == ["read", "decode", "cache", "crop_alt", "alt"]
    assert set(graph.sinks) == {"alt"}
