"""Parameter groups, optimizer construction and the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from entrenar.errors import CheckpointError, ConfigError
from entrenar.train.optim import LRSchedule, build_optimizer, build_param_groups, lr_at, set_lr


class ToyRMSNorm(nn.Module):
    """A norm that is not a torch class, with a 2-D scale so only its type marks it as a norm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ToyLora(nn.Module):
    def __init__(self, d: int, r: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.lora_A = nn.Linear(d, r, bias=False)
        self.lora_B = nn.Linear(r, d, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


class ToyModel(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, d)
        self.proj = ToyLora(d)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict({"gate": nn.Linear(d, 4, bias=False), "up": nn.Linear(d, d)})
        self.final_norm = ToyRMSNorm(d)


def _group_of(groups: list[dict], name: str) -> dict:
    (group,) = [g for g in groups if name in g["names"]]
    return group


def test_groups_cover_trainable_params_once_and_skip_frozen() -> None:
    model = ToyModel()
    groups = build_param_groups(model, weight_decay=0.1)
    names = [n for g in groups for n in g["names"]]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(names) == sorted(trainable)
    assert "proj.base.weight" not in names and "proj.base.bias" not in names
    for g in groups:
        assert [id(p) for p in g["params"]] == [id(dict(model.named_parameters())[n]) for n in g["names"]]


def test_no_weight_decay_on_norms_biases_and_vectors() -> None:
    groups = build_param_groups(ToyModel(), weight_decay=0.1)
    for name in ["norm.weight", "norm.bias", "mlp.up.bias", "final_norm.weight"]:
        assert _group_of(groups, name)["weight_decay"] == 0.0, name
    for name in ["embed.weight", "proj.lora_A.weight", "proj.lora_B.weight", "mlp.gate.weight", "mlp.up.weight"]:
        assert _group_of(groups, name)["weight_decay"] == 0.1, name


def test_weight_decay_applies_only_to_decayed_groups() -> None:
    # With zero gradients AdamW's adaptive update is 0, so one step multiplies a
    # decayed weight by (1 - lr * wd) and leaves an undecayed one unchanged.
    model = ToyModel()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(build_param_groups(model, weight_decay=0.5), "adamw", lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    params = dict(model.named_parameters())
    torch.testing.assert_close(params["mlp.up.weight"], before["mlp.up.weight"] * (1 - 0.1 * 0.5))
    torch.testing.assert_close(params["norm.weight"], before["norm.weight"])
    torch.testing.assert_close(params["final_norm.weight"], before["final_norm.weight"])


def test_lr_scale_by_param_or_module_name() -> None:
    groups = build_param_groups(ToyModel(), weight_decay=0.0, lr_scale={"lora_B": 16.0, r"mlp\.gate$": 0.25})
    assert _group_of(groups, "proj.lora_B.weight")["lr_scale"] == 16.0
    assert _group_of(groups, "mlp.gate.weight")["lr_scale"] == 0.25  # `$` anchors on the module name
    assert _group_of(groups, "proj.lora_A.weight")["lr_scale"] == 1.0
    assert _group_of(groups, "mlp.up.weight")["lr_scale"] == 1.0


def test_set_lr_scales_each_group_and_sgd_step_follows() -> None:
    model = ToyModel()
    groups = build_param_groups(model, weight_decay=0.0, lr_scale={"lora_B": 4.0})
    opt = build_optimizer(groups, "sgd", lr=1.0, momentum=0.9)
    set_lr(opt, 0.01)
    assert {g["lr"] for g in opt.param_groups} == {0.01, 0.04}
    b = model.proj.lora_B.weight
    a = model.proj.lora_A.weight
    b0, a0 = b.detach().clone(), a.detach().clone()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # first SGD momentum step: buffer = grad, update = lr * grad
    torch.testing.assert_close(b, b0 - 0.04)
    torch.testing.assert_close(a, a0 - 0.01)


@pytest.mark.parametrize(
    "lr_scale, match",
    [
        ({"lora_C": 2.0}, "match no trainable parameter"),
        ({"proj.base": 2.0}, "match no trainable parameter"),  # frozen parameters do not count
        ({"lora": 2.0, "lora_B": 3.0}, "different multipliers"),
        ({"lora_(": 2.0}, "not a valid regular expression"),
        ({"lora_B": -1.0}, "positive number"),
    ],
)
def test_lr_scale_errors(lr_scale: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_param_groups(ToyModel(), weight_decay=0.0, lr_scale=lr_scale)


def test_no_trainable_params_is_an_error() -> None:
    model = ToyModel().requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        build_param_groups(model, weight_decay=0.0)


def test_fused_choice_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    model = ToyModel()
    auto = build_optimizer(build_param_groups(model, 0.0), "adamw", lr=1e-3, fused="auto", device="cpu")
    assert not auto.param_groups[0]["fused"]  # auto means fused on CUDA only
    explicit = build_optimizer(build_param_groups(model, 0.0), "adamw", lr=1e-3, fused=True)
    assert explicit.param_groups[0]["fused"]  # torch >= 2.4 has a fused CPU AdamW

    def unsupported(*args, **kwargs):
        raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")

    monkeypatch.setattr(torch.optim, "AdamW", unsupported)
    with pytest.raises(ConfigError, match="fused=true is not supported"):
        build_optimizer(build_param_groups(model, 0.0), "adamw", lr=1e-3, fused=True)
    with pytest.raises(ConfigError, match="'adamw' or 'sgd'"):
        build_optimizer(build_param_groups(model, 0.0), "lion", lr=1e-3)
    with pytest.raises(ConfigError, match="fused"):
        build_optimizer(build_param_groups(model, 0.0), "sgd", lr=1e-3, fused="yes")


def test_warmup_is_linear_from_zero() -> None:
    base, warmup = 3e-4, 4
    lrs = [lr_at(s, base, warmup, 100) for s in range(warmup + 1)]
    assert lrs == pytest.approx([base * (s + 1) / (warmup + 1) for s in range(warmup + 1)])
    assert lrs[-1] == pytest.approx(base)  # the first step after warmup is at the peak
    assert lr_at(0, base, 0, 100) == base  # no warmup


def _hf_lambda(kind: str, warmup: int, total: int, min_ratio: float):
    transformers_optimization = pytest.importorskip("transformers.optimization")
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    if kind == "cosine":
        sched = transformers_optimization.get_cosine_with_min_lr_schedule_with_warmup(
            opt, warmup, total, min_lr_rate=min_ratio
        )
    else:
        sched = transformers_optimization.get_linear_schedule_with_warmup(opt, warmup, total)
    return sched.lr_lambdas[0]


@pytest.mark.parametrize("kind, min_ratio", [("cosine", 0.1), ("cosine", 0.0), ("linear", 0.0)])
def test_decay_matches_transformers_after_warmup(kind: str, min_ratio: float) -> None:
    base, warmup, total = 2e-4, 10, 50
    reference = _hf_lambda(kind, warmup, total, min_ratio)
    # transformers' cosine keeps cycling past the end; ours stays at the floor (tested below).
    for step in range(warmup, total + 1):
        assert lr_at(step, base, warmup, total, kind, min_ratio) == pytest.approx(base * reference(step), abs=1e-12)


def test_linear_floor_and_constant() -> None:
    base = 1.0
    assert lr_at(5, base, 0, 10, "linear", 0.2) == pytest.approx(0.2 + 0.8 * 0.5)
    assert lr_at(10, base, 0, 10, "linear", 0.2) == pytest.approx(0.2)
    assert lr_at(99, base, 0, 10, "cosine", 0.2) == pytest.approx(0.2)
    assert [lr_at(s, base, 2, 10, "constant") for s in range(5)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1])
    mid = lr_at(5, base, 0, 10, "cosine", 0.0)
    assert mid == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"schedule": "exponential"}, "schedule.name"),
        ({"warmup_steps": 11}, "warmup_steps"),
        ({"max_steps": 0, "warmup_steps": 0}, "max_steps"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
    ],
)
def test_schedule_errors(kwargs: dict, match: str) -> None:
    args = {"step": 0, "base_lr": 1.0, "warmup_steps": 2, "max_steps": 10} | kwargs
    with pytest.raises(ConfigError, match=match):
        lr_at(**args)


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_a_schedule_of_one_length_is_lr_at_to_the_bit(kind: str) -> None:
    """A run that never changes its length keeps the learning rates (and so the losses) of lr_at exactly."""
    schedule = LRSchedule.of(3e-4, 5, 40, kind, 0.1)
    assert [schedule.lr(s) for s in range(45)] == [lr_at(s, 3e-4, 5, 40, kind, 0.1) for s in range(45)]
    assert schedule.resumed(17, 40, "rescale", 3e-4, 5) is schedule  # the same length: nothing changes


def test_an_extended_linear_schedule_continues_rewarms_or_rescales() -> None:
    base, floor = 1.0, 0.2
    schedule = LRSchedule.of(base, 2, 10, "linear", 0.2)
    old = [lr_at(s, base, 2, 10, "linear", 0.2) for s in range(10)]
    resumed = {how: schedule.resumed(6, 20, how, base, 2) for how in ("continue", "rewarm", "rescale")}
    by_hand = {
        "continue": [floor + (old[6] - floor) * (1 - (s - 6) / 14) for s in range(6, 20)],
        "rewarm": [base / 3, 2 * base / 3] + [floor + (base - floor) * (1 - (s - 8) / 12) for s in range(8, 20)],
        "rescale": [floor + (base - floor) * (1 - (s - 2) / 18) for s in range(6, 20)],
    }
    for how, expected in by_hand.items():
        lrs = [resumed[how].lr(s) for s in range(20)]
        assert lrs[6:] == pytest.approx(expected, rel=1e-12), how  # the steps before 6 were taken already
        assert lrs[19] > floor and resumed[how].lr(20) == pytest.approx(floor)
    # Interrupted during warmup: continue finishes the warmup and decays over the new length (as rescale does).
    assert schedule.resumed(1, 20, "continue", base, 2) == schedule.resumed(1, 20, "rescale", base, 2)
    # The segments round-trip through trainer.json; a damaged list is refused naming the file.
    twice = resumed["continue"].resumed(12, 30, "rewarm", base, 2)
    assert LRSchedule("linear", floor, ()).load_state_dict(twice.state_dict(), "t.json") == twice
    with pytest.raises(CheckpointError, match=r"t\.json: 'schedule' must be a list of segments"):
        LRSchedule("linear", floor, ()).load_state_dict([{"start": 0, "end": "9"}], "t.json")


def test_qat_step_sizes_are_never_decayed():
    from entrenar.quant.qat import QATConfig, prepare_qat

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    prepare_qat(model, QATConfig(bits=4, backward="lsq", target_modules=["0", "1"]))
    groups = build_param_groups(model, weight_decay=0.1)
    decayed = {n for g in groups if g["weight_decay"] > 0 for n in g["names"]}
    assert decayed == {"0.weight", "1.weight"}
