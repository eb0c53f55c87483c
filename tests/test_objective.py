"""The value a run returns to a Hydra sweeper (objective.of, objective.metric), read from results the
test writes by hand."""
import math

import pytest
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.config import ConfigError, check_objective, check_sweeper, swept, sweeper_direction
from pipeline.measure.objective import Metric, objective_value
from tests.conftest import compose_config, member


def results(kept: dict | None) -> dict:
    return {"models": [{"name": "a", "val_accuracy": [0.5, 0.7, 0.6], "val_loss": [1.0, 0.8, 0.9]},
                       {"name": "b", "val_accuracy": [0.6, 0.65], "val_loss": [0.9, 0.7]},
                       {"name": "c", "val_accuracy": [], "val_loss": []}],  # failed before validating
            "ensemble": {"kept": kept, "final_val_accuracy": 0.72, "final_val_loss": 0.65}}


@pytest.mark.parametrize("of, metric, value", [
    ("a", Metric.val_accuracy, 0.7),  # its best epoch, not its last (0.6)
    ("a", Metric.val_loss, 0.8),
    ("best_member", Metric.val_accuracy, 0.7),  # a's
    ("best_member", Metric.val_loss, 0.7),  # b's: the lowest loss, whoever has it
    ("ensemble", Metric.val_accuracy, 0.75),  # the ensemble of best checkpoints the run leaves
    ("ensemble", Metric.val_loss, 0.6),
    ("c", Metric.val_accuracy, None),  # nothing validated: nothing to return
])
def test_a_member_counts_its_best_epoch_and_the_ensemble_its_kept_checkpoints(of, metric, value):
    assert objective_value(results({"val_accuracy": 0.75, "val_loss": 0.6}), of, metric) == value


@pytest.mark.parametrize("order", [1, -1])
def test_a_diverged_members_nan_loss_is_never_the_best(order):
    """A member whose loss became NaN (it diverged) is no member's or the run's best, wherever it stands:
    min() returned the NaN when it came first, and the run then returned nothing (a failed Optuna trial)."""
    models = [{"name": "x", "val_accuracy": [0.1, 0.1], "val_loss": [math.nan, math.nan]},
              {"name": "y", "val_accuracy": [0.5, 0.6], "val_loss": [0.9, math.nan]}][::order]
    run = {"models": models, "ensemble": {"kept": None}}
    assert objective_value(run, "best_member", Metric.val_loss) == 0.9
    assert objective_value(run, "y", Metric.val_loss) == 0.9 and objective_value(run, "x", Metric.val_loss) is None


def test_the_ensemble_without_a_checkpoint_of_every_member_counts_their_last_epochs():
    assert objective_value(results(None), "ensemble", Metric.val_accuracy) == 0.72
    assert objective_value(results(None), "ensemble", Metric.val_loss) == 0.65


def test_each_metric_says_the_direction_a_sweeper_must_take():
    assert (Metric.val_accuracy.direction, Metric.val_loss.direction) == ("maximize", "minimize")


def test_an_objective_naming_no_member_is_refused_with_the_names_there_are():
    with pytest.raises(ConfigError, match=r"objective.of=resnet: no member has that name; give ensemble, "
                                          r"best_member or a member's name \(a, b\)"):
        check_objective(compose_config(["objective.of=resnet"]).objective, [member("a"), member("b")])
    check_objective(compose_config(["objective.of=b"]).objective, [member("a"), member("b")])


def test_a_sweeper_is_read_for_the_way_it_optimises():
    """Optuna's config (the real plugin's, composed: its default is minimize) and those Nevergrad and Ax
    declare; Hydra's basic sweeper optimises nothing."""
    sweeper = lambda *overrides: compose_config(list(overrides), with_hydra=True).hydra.sweeper
    assert sweeper_direction(sweeper()) is None
    assert sweeper_direction(sweeper("hydra/sweeper=optuna")) == ("hydra.sweeper.direction", "minimize", "minimize")
    assert sweeper_direction(sweeper("hydra/sweeper=optuna", "hydra.sweeper.direction=maximize"))[2] == "maximize"
    assert sweeper_direction(OmegaConf.create({"direction": ["maximize", "minimize"]})) is None  # two objectives
    assert sweeper_direction(OmegaConf.create({"optim": {"maximize": True}})) == \
        ("hydra.sweeper.optim.maximize", "true", "maximize")
    assert sweeper_direction(OmegaConf.create({"ax_config": {"experiment": {"minimize": True}}})) == \
        ("hydra.sweeper.ax_config.experiment.minimize", "true", "minimize")


def test_a_sweeper_that_optimises_the_other_way_than_the_metric_is_refused_saying_both_fixes():
    optuna = compose_config(["hydra/sweeper=optuna"], with_hydra=True).hydra.sweeper  # minimize, its default
    with pytest.raises(ConfigError) as refused:
        check_sweeper(compose_config([]).objective, optuna)  # the ensemble's accuracy
    assert str(refused.value) == (
        "hydra.sweeper.direction=minimize: the sweeper would minimize what each job returns, but "
        "objective.metric=val_accuracy is better when higher; set hydra.sweeper.direction=maximize, or "
        "objective.metric=val_loss")
    check_sweeper(compose_config(["objective.metric=val_loss"]).objective, optuna)
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.optim.maximize=true: .* is better when lower; set "
                                          r"hydra.sweeper.optim.maximize=false, or objective.metric=val_accuracy$"):
        check_sweeper(compose_config(["objective.metric=val_loss"]).objective,
                      OmegaConf.create({"optim": {"maximize": True}}))
    check_sweeper(compose_config([]).objective, None)  # not a multirun's


def multirun(task: list[str], **sweeper) -> DictConfig:
    """The default ensemble's config as a multirun's first one is: `task`, the command line's overrides,
    as Hydra records them (a sweep's values not applied)."""
    cfg = compose_config(["+ensemble=caltech256"], with_hydra=True)
    with open_dict(cfg):
        cfg.hydra.overrides.task, cfg.hydra.sweeper = task, sweeper
    return cfg


def test_a_key_is_swept_where_the_command_line_or_the_sweepers_search_space_may_vary_it():
    """The multirun-wide direction check (pipeline.callbacks.CheckSweeper) leaves a swept metric to each job:
    swept itself (+ or ++ before it too), above it, by a config group or a key this config lacks (either may
    set it), or in the sweeper's search space. An override's ${...} is not resolved (an unset variable
    would raise)."""
    fixed = ["objective.metric=val_loss", "ensemble.models.0.optimizer.lr=0.1,0.2",
             "dataset.val_per_class=0.1,0.2", "dataset.root=${oc.env:SURELY_UNSET_VARIABLE}", "~seed"]
    assert not swept(multirun(fixed), "objective.metric")
    assert not swept(multirun([], params={"ensemble.models.0.optimizer.lr": "interval(0.01, 0.2)"}), "objective.metric")
    for task in ("objective.metric=val_loss,val_accuracy", "objective.metric=choice(val_loss)",
                 "++objective.metric=val_loss,val_accuracy", "objective={of:ensemble,metric:val_loss},{}",
                 "+experiment=a,b", "ensemble=caltech256,caltech256_paper"):
        assert swept(multirun([task]), "objective.metric"), task
    space = {"objective.metric": "choice(val_loss, val_accuracy)"}
    for sweeper in ({"params": space}, {"parametrization": space}, {"ax_config": {"params": space}}):
        assert swept(multirun([], **sweeper), "objective.metric"), sweeper
