"""Optimizer and scheduler builders."""

import pytest
import torch

from policyworker.config import load_config
from policyworker.shell.model.optim import build_optimizer, build_scheduler, resolve_dotted


def _model():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    return model


def test_optimizer_covers_only_trainable_params():
    model = _model()
    opt = build_optimizer(model, {"name": "torch.optim.AdamW", "kwargs": {"lr": 0.1}})
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == 3 and all(p is not model[0].weight for p in params)
    assert opt.param_groups[0]["lr"] == 0.1


def test_torch_string_kwargs_are_resolved():
    assert resolve_dotted("torch.bfloat16", key="x") is torch.bfloat16
    from policyworker.shell.model.optim import _resolve_kwargs

    assert _resolve_kwargs({"dtype": "torch.float16", "lr": 1}, key="optimizer.kwargs") == {
        "dtype": torch.float16,
        "lr": 1,
    }


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"name": "torch.optim.NoSuchOptimizer"}, "optimizer.name"),
        ({"name": "AdamW"}, "optimizer.name"),
        ({"name": "torch.optim.AdamW", "kwargs": {"nonsense": 1}}, "optimizer.kwargs"),
    ],
)
def test_bad_optimizer_config_names_the_key(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_optimizer(_model(), cfg)


def test_constant_scheduler_when_absent():
    opt = build_optimizer(_model(), {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}})
    sched = build_scheduler(opt, None)
    for _ in range(3):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.5


def test_dict_and_milestone_list_schedulers_from_the_config():
    opt = build_optimizer(_model(), {"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}})
    single = load_config(
        {
            "model_name": "x",
            "scheduler": {
                "name": "torch.optim.lr_scheduler.StepLR",
                "kwargs": {"step_size": 1, "gamma": 0.5},
            },
        }
    )
    assert isinstance(build_scheduler(opt, single.scheduler), torch.optim.lr_scheduler.StepLR)
    opt = build_optimizer(_model(), {"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}})
    seq = load_config(
        {
            "model_name": "x",
            "scheduler": [
                {
                    "name": "torch.optim.lr_scheduler.LinearLR",
                    "kwargs": {"start_factor": 0.5, "end_factor": 1.0, "total_iters": 2},
                },
                {
                    "name": "torch.optim.lr_scheduler.ConstantLR",
                    "kwargs": {"factor": 1.0, "total_iters": 1},
                },
                {"milestones": [2]},
            ],
        }
    )
    sched = build_scheduler(opt, seq.scheduler)
    assert isinstance(sched, torch.optim.lr_scheduler.SequentialLR)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.5) and lrs[-1] == pytest.approx(1.0)


def test_raw_list_scheduler_needs_one_milestones_entry():
    opt = build_optimizer(_model(), {"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}})
    with pytest.raises(ValueError, match="milestones"):
        build_scheduler(
            opt, [{"name": "torch.optim.lr_scheduler.StepLR", "kwargs": {"step_size": 1}}]
        )
    with pytest.raises(ValueError, match="scheduler.name"):
        build_scheduler(opt, {"name": "torch.optim.lr_scheduler.Nope"})
