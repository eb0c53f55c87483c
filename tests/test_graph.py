"""The stage DAG is built and checked on the driver, before any Dask work."""
import copy
import re
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.data.graph import GraphError, build_graph
from stages.base import Batch, BatchContext, DataKind, Spec, Split
from tests.conftest import compose_config
from tests.test_run import REPO


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
    assert "(module 'stages.decode' has no attribute 'Decoder')" in message


def test_a_stage_whose_module_fails_to_import_says_why(stages, tmp_path, monkeypatch):
    """A user's module that imports what is not installed: its own ImportError, not only "cannot import"."""
    (tmp_path / "their_stages.py").write_text("import albumentations_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stages["decode"]["_target_"] = "their_stages.Decode"
    assert "cannot import 'their_stages.Decode' (No module named 'albumentations_not_installed')" in errors_for(stages)


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


def test_a_type_error_a_stage_raises_as_it_is_made_is_its_own_not_a_missing_field(stages):
    stages["faulty"] = {"_target_": "tests.faulty_stage.Faulty", "inputs": ["crop_main"], "fault": "init"}
    stages["main"]["inputs"] = ["faulty"]
    with pytest.raises(TypeError, match="object of type 'int' has no len"):
        build_graph(stages, {"main", "alt"})


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


def without_cache(stages: dict) -> dict:
    """The graph with its crops fed by decode: a batch run here in the test's process keeps nothing."""
    del stages["cache"]
    stages["crop_main"]["inputs"] = stages["crop_alt"]["inputs"] = ["decode"]
    return stages


def batch_of(graph, split=Split.TRAIN, epoch=0) -> dict[str, Batch]:
    return graph.run(BatchContext(seed=0, split=split, epoch=epoch, index=0)).batches


def documented(language: str) -> str:
    """The `language` code block of configuration.md's "Your own stage"."""
    section = (REPO / "docs" / "configuration.md").read_text().split("### Your own stage")[1].split("\n## ")[0]
    (block,) = re.findall(rf"```{language}\n(.*?)```", section, re.S)
    return block


def test_the_documented_stage_of_ones_own_runs_in_the_graph_as_documented(stages, tmp_path, monkeypatch):
    """configuration.md's example stage, from a module of the user's, wired in by its config: each training
    image's brightness changes (every pixel by one factor; the same again for the same batch), validation's
    stays as it is, and a bad field value is refused naming its key."""
    (tmp_path / "my_stages.py").write_text(documented("python"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_stages", raising=False)
    plain = build_graph(without_cache(stages), {"main", "alt"})
    ours = copy.deepcopy(stages)
    for name, entry in OmegaConf.to_container(OmegaConf.create(documented("yaml")))["pipeline"]["stages"].items():
        ours[name] = {**ours.get(name, {}), **entry}
    graph = build_graph(ours, {"main", "alt"})
    assert graph.inputs["main"] == "bright" and graph.inputs["bright"] == "crop_main"
    before, after = batch_of(plain)["main"], batch_of(graph)["main"]
    assert after.paths == before.paths and after.data.shape == before.data.shape
    assert np.array_equal(batch_of(graph)["main"].data, after.data)
    assert graph.proven == set(graph.stages) - {"bright"}  # the project's own looked at once, the user's each time
    pixels = before.data.reshape(len(before.paths), -1)
    lit = (60 < pixels) & (pixels < 190)  # clear of rounding's share near 0 and of clipping at 255
    factors = [a[m].astype(float) / b[m] for a, b, m in zip(after.data.reshape(len(lit), -1), pixels, lit)]
    assert all(0.69 < np.median(f) < 1.31 and np.ptp(f) < 0.05 for f in factors)  # strength 0.3, one factor each
    assert np.ptp([np.median(f) for f in factors]) > 0.05  # drawn for each image
    assert np.array_equal(batch_of(graph, Split.VAL)["main"].data, batch_of(plain, Split.VAL)["main"].data)
    ours["bright"]["strength"] = 1.5
    assert errors_for(ours) == "pipeline.stages.bright: strength must be in [0, 1), got 1.5"


@pytest.mark.parametrize("fault, made", [
    ("short", r"made an array of uint8 \[(\d+), 63, 64, 3\], not the tensor\[64, 64, 3\] it declares \(one uint8 "
              r"array of shape \[\1, 64, 64, 3\]\)"),
    ("dtype", r"made an array of float32 \[(\d+), 64, 64, 3\], not the tensor\[64, 64, 3\] it declares \(one uint8 "
              r"array of shape \[\1, 64, 64, 3\]\)"),
    ("list", r"made a list, not the tensor\[64, 64, 3\] it declares \(one uint8 array of shape \[\d+, 64, 64, 3\]\)"),
    ("labels short", r"made (\d+) items with \d+ labels and \1 paths \(a Batch has one label and one path per item\)"),
    ("labels a list", r"made labels that are a list, not one int64 array of a label per item"),
    ("labels float", r"made labels that are an array of float64 \[\d+\], not one int64 array of a label per item"),
    ("labels a column", r"made labels that are an array of int64 \[\d+, 1\], not one int64 array of a label per item"),
    ("no paths", r"made paths that are a NoneType, not a list of a path \(str\) per item"),
    ("paths not str", r"made paths that are a list, not a list of a path \(str\) per item"),
    ("twice", r"made 112 items, more than a batch task holds \(64\)"),
    ("labels past the classes", r"made labels from 4 to 7, not class indices of the 4 classes"),
    ("nothing", r"returned a NoneType, not a stages.base.Batch"),
])
def test_a_stage_whose_output_is_not_what_it_declares_is_named_at_its_first_batch(stages, fault, made):
    """A stage's output is what the stages after it (and the trainers) take as its output_spec declares: one
    that makes something else stops the run naming the stage, what it made and the batch (before, a shape
    one row short failed in the hub's ring copy, with numpy's words and no stage named; float labels were cut
    to integers there)."""
    stages["faulty"] = {"_target_": "tests.faulty_stage.Faulty", "inputs": ["crop_main"], "fault": fault}
    stages["main"]["inputs"] = ["faulty"]
    graph = build_graph(without_cache(stages), {"main", "alt"})
    with pytest.raises(GraphError) as err:
        batch_of(graph, epoch=2)
    assert re.fullmatch(rf"pipeline.stages.faulty \(tests.faulty_stage.Faulty\), making train batch 0 of epoch 2: "
                        rf"{made}; make its __call__ return what its output_spec declares", str(err.value)), err.value


def test_an_error_a_stage_raises_keeps_its_traceback_and_names_the_stage_and_batch(stages):
    stages["faulty"] = {"_target_": "tests.faulty_stage.Faulty", "inputs": ["crop_alt"], "fault": "raise"}
    stages["alt"]["inputs"] = ["faulty"]
    graph = build_graph(without_cache(stages), {"main", "alt"})
    with pytest.raises(ZeroDivisionError, match="a bug of the stage's own") as err:
        batch_of(graph, Split.VAL, epoch=1)
    assert err.value.__notes__ == ["in pipeline.stages.faulty (tests.faulty_stage.Faulty), making val batch 0 of "
                                   "epoch 1"]
    stages["faulty"]["fault"] = "refuse"  # the user's error, named where it was met
    with pytest.raises(GraphError) as err:
        batch_of(build_graph(stages, {"main", "alt"}), Split.VAL, epoch=1)
    assert str(err.value) == ("pipeline.stages.faulty (tests.faulty_stage.Faulty), making val batch 0 of epoch 1: "
                              "this batch cannot be brightened; lower strength")


def test_images_and_files_are_held_to_their_kind():
    labels, paths = np.zeros(2, dtype=np.int64), ["a.jpg", "b.jpg"]
    rgb = np.zeros((5, 7, 3), dtype=np.uint8)
    images = Spec(DataKind.IMAGES)
    for whole in (Batch([rgb, rgb], labels, paths), Batch([], labels[:0], [])):  # the latter: every file skipped
        assert images.broken_by(whole, 2, 1) is None and images.items_broken_by(whole) is None
    assert images.items_broken_by(Batch([rgb, rgb[..., 0]], labels, paths)) == (
        "made an array of uint8 [5, 7] of b.jpg, not the RGB image it declares (uint8, height x width x 3)")
    assert images.items_broken_by(Batch([rgb, rgb.astype(np.float32)], labels, paths)).startswith(
        "made an array of float32 [5, 7, 3] of b.jpg")
    encoded = Spec(DataKind.ENCODED)
    files = Batch([b"\xff\xd8", b""], labels, paths)
    assert encoded.broken_by(files, 2, 1) is None and encoded.items_broken_by(files) is None
    assert encoded.items_broken_by(Batch([b"\xff\xd8", "text"], labels, paths)) == (
        "made items that are not bytes, not the encoded files it declares")
    tensor = Spec(DataKind.TENSOR, (5, 7, 3))
    for data, made in ((None, "a NoneType"), (np.array(3), "an array of int64 []")):
        assert tensor.broken_by(Batch(data, labels, paths), 2, 1) == (
            f"made {made}, not a list of items or one array of them")
    assert tensor.broken_by(Batch(np.zeros((2, 5, 7, 3), np.uint8), labels - 1, paths), 2, 1) == (
        "made labels from -1 to -1, not class indices of the 1 classes")


def test_a_stage_that_declares_no_spec_or_a_tensor_without_its_shape_is_refused(stages, monkeypatch):
    stages["faulty"] = {"_target_": "tests.faulty_stage.Faulty", "inputs": ["crop_main"]}
    stages["main"]["inputs"] = ["faulty"]
    for declared in (None, Spec(DataKind.TENSOR), Spec(DataKind.TENSOR, (64, 64)), Spec(DataKind.TENSOR, 64),
                     Spec("tensor", (64, 64, 3)), Spec(DataKind.TENSOR, (64.0, 64.0, 3))):
        monkeypatch.setattr("tests.faulty_stage.Faulty.output_spec", lambda self, given: declared)
        assert errors_for(stages) == (f"pipeline.stages.faulty: tests.faulty_stage.Faulty.output_spec returned "
                                      f"{declared!r}, not a stages.base.Spec of what it makes (a tensor's with its "
                                      "item shape: (height, width, 3), positive ints)")


def test_a_sink_that_hands_out_no_square_tensor_is_refused(stages):
    """A model is built for one image side: a sink of decoded images of any size, or of oblong ones, cannot
    feed it (image_sizes failed with a TypeError)."""
    images = {**stages, "alt": {"_target_": "tests.faulty_stage.ImagesSink", "inputs": ["cache"]}}
    del images["crop_alt"]
    assert errors_for(images) == ("pipeline.stages.alt: tests.faulty_stage.ImagesSink is a sink making images; a sink "
                                  "hands the models square images of one size (a tensor of (side, side, 3)): feed it "
                                  "from a crop")
    stages["oblong"] = {"_target_": "tests.faulty_stage.Oblong", "inputs": ["crop_main"]}
    stages["main"]["inputs"] = ["oblong"]
    assert errors_for(stages) == ("pipeline.stages.main: stages.broadcast.Broadcast is a sink making tensor[64, 32, "
                                  "3]; a sink hands the models square images of one size (a tensor of (side, side, "
                                  "3)): feed it from a crop")


def test_a_built_in_stage_that_breaks_its_spec_is_a_bug_not_the_users_mistake(stages, monkeypatch):
    graph = build_graph(without_cache(stages), {"main", "alt"})
    monkeypatch.setattr(graph.stages["crop_alt"], "size", 47)  # it makes 47 px where it declared 48
    bug = (r"^pipeline.stages.crop_alt \(stages.augment.RandomResizedCropFlip\), making train batch 0 of epoch 0: "
           r"made an array of uint8 \[\d+, 47, 47, 3\], not the tensor\[48, 48, 3\] .* \(a bug in the project's own "
           r"stage\)$")
    with pytest.raises(RuntimeError, match=bug):
        batch_of(graph)
