"""entrenar ablate: arms trained through the one loop, the dense match, the report, resuming, and the mutual
information of routing held against a hand-computed table and scikit-learn."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from entrenar.config import Recipe
from entrenar.data import synth
from entrenar.errors import ConfigError
from entrenar.experiments import ablate as ab
from entrenar.models import random_init as scratch
from entrenar.models.transformer import Transformer
from entrenar.train.metrics import MetricsLogger

MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True,
       "max_position_embeddings": 64}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 4, "num_experts_per_tok": 2,
           "max_position_embeddings": 64}


def recipe(tmp_path=None, config=MOE, **training) -> Recipe:
    return Recipe.from_dict({
        "model": {"init": "random", "device": "cpu", "config": config},
        "data": {"train": "synth:mixture:48", "validation_split": 0.1, "seq_len": 32, "train_on": "completion"},
        "lora": None, "optimizer": {"lr": 3e-3},
        "training": {"max_steps": 2, "batch_size": 2, "eval_every": 0, "save_every": 1, "log_every": 1,
                     **training},
        "output": {"dir": str(tmp_path / "run") if tmp_path else "runs/t"},
        "moe": {"aux_loss": 0.01}})


# -- mutual information ------------------------------------------------------------------------


def test_mutual_information_of_a_hand_computed_table():
    # p(task, expert) = [[4, 0], [1, 3]] / 8; p(task) = (1/2, 1/2), p(expert) = (5/8, 3/8).
    mi, h = ab.mutual_information([[4, 0], [1, 3]])
    expected = (4 / 8) * math.log2((4 / 8) / (1 / 2 * 5 / 8)) + (1 / 8) * math.log2((1 / 8) / (1 / 2 * 5 / 8)) \
        + (3 / 8) * math.log2((3 / 8) / (1 / 2 * 3 / 8))
    assert mi == pytest.approx(expected, abs=1e-12) and expected == pytest.approx(0.548795, abs=1e-6)
    assert h == pytest.approx(1.0)
    assert ab.mutual_information([[2, 2], [3, 3]])[0] == pytest.approx(0.0, abs=1e-12)  # independent
    mi, h = ab.mutual_information([[5, 0, 0], [0, 5, 0], [0, 0, 10]])  # each task its own expert: MI = H(task)
    assert mi == pytest.approx(h) and h == pytest.approx(1.5)


def test_mutual_information_equals_scikit_learn_in_nats():
    from sklearn.metrics import mutual_info_score

    rng = random.Random(0)
    tasks = [rng.randrange(4) for _ in range(500)]
    experts = [(t * 2 + rng.randrange(3)) % 8 for t in tasks]  # routing that depends on the task, noisily
    table = [[0] * 8 for _ in range(4)]
    for t, e in zip(tasks, experts, strict=True):
        table[t][e] += 1
    mi, _ = ab.mutual_information(table)
    assert mi * math.log(2) == pytest.approx(mutual_info_score(tasks, experts), abs=1e-10)
    assert mi > 0.5


# -- arms and the dense match --------------------------------------------------------------------


@pytest.mark.parametrize("match", ["active", "total"])
@pytest.mark.parametrize("family, dense", [("qwen3_moe", "qwen3"), ("mixtral", "mistral")])
def test_dense_arm_matches_the_moe_count_to_the_nearest_width(match, family, dense):
    r = recipe(config=MOE if family == "qwen3_moe" else MIXTRAL)
    moe = scratch.model_config(r)
    hf, m = ab.dense_config(r, match)
    assert hf["model_type"] == dense and m["family"] == dense
    assert m["target"] == (moe.num_active_parameters if match == "active" else moe.num_parameters)
    model = Transformer(scratch.model_config(ab.arm_recipe(r, "dense", Path("x"), match)))
    achieved = sum(p.numel() for p in model.parameters())  # the modules themselves, not the formula
    assert achieved == m["achieved"] and m["relative_mismatch"] == (achieved - m["target"]) / m["target"]
    # The nearest integer width: within half of one width step, and the neighbours are no closer.
    assert abs(achieved - m["target"]) <= m["step"] / 2
    assert abs(m["relative_mismatch"]) < 0.01
    assert m["step"] == 3 * moe.hidden_size * moe.num_layers
    assert model.config.qk_norm == moe.qk_norm and model.config.num_kv_heads == moe.num_kv_heads
    if match == "total":
        assert m["achieved"] > ab.dense_config(r, "active")[1]["achieved"]


def test_the_sigmoid_arm_changes_only_the_routing_and_balancing(tmp_path):
    r = recipe(tmp_path)
    arm = ab.arm_recipe(r, "moe-sigmoid", tmp_path / "s")
    assert arm.model.config == {**MOE, "scoring_func": "sigmoid"}
    assert (arm.moe.aux_loss, arm.moe.bias_update_rate, arm.moe.z_loss) == (0.0, ab.BIAS_UPDATE_RATE, r.moe.z_loss)
    assert arm.data == r.data and arm.training == r.training and arm.optimizer == r.optimizer
    assert scratch.model_config(arm).router_scoring == "sigmoid"
    dense = ab.arm_recipe(r, "dense", tmp_path / "d")
    assert dense.moe == type(r.moe)() and dense.data == r.data and dense.training == r.training


@pytest.mark.parametrize("config, message", [
    ({"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1}, "has no mixture-of-experts layers"),
    ({**MOE, "scoring_func": "sigmoid"}, "already routes with scoring_func sigmoid"),
])
def test_recipes_that_cannot_be_ablated_are_refused(config, message):
    r = Recipe.from_dict({"model": {"init": "random", "config": config}, "data": {"train": "synth:mixture:8"}})
    with pytest.raises(ConfigError, match=message):
        ab.check_recipe(r, "r.yaml")


def test_olmoe_has_no_dense_arm_and_arm_names_are_checked():
    olmoe = {k: v for k, v in MOE.items() if k not in ("moe_intermediate_size",)}
    with pytest.raises(ConfigError, match="olmoe has no dense family"):
        ab.dense_config(recipe(config={**olmoe, "model_type": "olmoe"}))
    assert ab.parse_arms("dense,moe") == ("dense", "moe")
    with pytest.raises(ConfigError, match="unknown arm 'moe-relu'"):
        ab.parse_arms("moe,moe-relu")
    with pytest.raises(ConfigError, match="name each arm once"):
        ab.parse_arms("moe,moe")


# -- training the arms -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ablate")
    lines: list[str] = []
    report = ab.ablate(recipe(tmp), output=tmp / "out", say=lines.append, mi_records=16)
    return report, lines


def test_every_arm_trains_on_the_same_data_and_the_report_has_its_fields(ablation):
    report, lines = ablation
    assert [line for line in lines if line.startswith("arm ")] == [f"arm {a}: training in {report.output / a}"
                                                                  for a in ab.ARMS]
    assert sum("held-out loss" in line for line in lines) == 3  # each run's own summary, as `train` prints it
    saved = json.loads((report.output / "ablation.json").read_text())
    assert list(saved["arms"]) == list(ab.ARMS) and saved["match"]["match"] == "active"
    for name, arm in saved["arms"].items():
        for key in ("train_loss", "eval_loss", "tokens_per_s", "parameters", "active_parameters"):
            assert isinstance(arm[key], (int, float)) and arm[key] > 0, (name, key)
        assert arm["steps"] == 2 and len(arm["curve"]) == 2
        assert arm["train_loss"] == arm["curve"][-1][1]  # the last 10% of two steps: the last one
    # Same data, seed and steps: every arm saw the same tokens at each step.
    tokens = [[r["tokens"] for r in map(json.loads, (report.output / a / "metrics.jsonl").read_text().splitlines())
               if "loss" in r] for a in ab.ARMS]
    assert tokens[0] == tokens[1] == tokens[2]
    arms = saved["arms"]
    assert arms["dense"]["parameters"] == arms["dense"]["active_parameters"] == saved["match"]["achieved"]
    assert arms["moe"]["active_parameters"] == saved["match"]["target"]
    for name in ("moe", "moe-sigmoid"):
        assert 0 < arms[name]["router_entropy_norm"] <= 1
        layers = arms[name]["specialisation"]["layers"]
        assert sorted(layers) == ["0", "1"] and arms[name]["specialisation"]["records"] == 16
        for d in layers.values():
            table = d["all"]["table"]
            mi, h = ab.mutual_information(table)
            assert (d["all"]["mi_bits"], d["all"]["task_entropy_bits"]) == (mi, h) and 0 <= mi <= h
            assert sum(map(sum, d["answer"]["table"])) < sum(map(sum, table))
    assert "router" not in arms["dense"] and "specialisation" not in arms["dense"]
    sigmoid = json.loads((report.output / "moe-sigmoid" / "checkpoints" / "step-2" / "trainer.json").read_text())
    assert any(v != 0 for layer in sigmoid["moe"]["bias"] for v in layer)  # the aux-loss-free bias moved
    text = (report.output / "ablation.md").read_text()
    for name in ab.ARMS:
        assert f"| {name} | {arms[name]['parameters']:,} |" in text
    assert "Dense arm: qwen3 with intermediate_size" in text and "## Routing specialisation (16 held-out" in text
    assert (report.output / "ablation_loss.png").stat().st_size > 1000


def test_the_table_counts_every_routed_slot_of_the_held_out_tokens(ablation):
    report, _ = ablation
    from entrenar.data import tokenize_records

    records = ab.heldout_records(recipe(), 16)
    assert records[0] == synth.mixture_record(0, 48)  # the records after data.train's 48, from its seed
    examples, _ = tokenize_records(records, scratch.byte_tokenizer(), 32, train_on="completion")
    tokens = sum(len(x.input_ids) for x in examples)
    spec = json.loads((report.output / "moe" / "arm.json").read_text())["specialisation"]
    for d in spec["layers"].values():
        assert sum(map(sum, d["all"]["table"])) == 2 * tokens  # top-2: two slots per token
        per_task = [sum(row) for row in d["all"]["table"]]
        assert per_task == [2 * sum(len(x.input_ids) for x, r in zip(examples, records) if r["task"] == t)
                            for t in range(4)]


def test_a_rerun_skips_finished_arms_and_resumes_an_interrupted_one(ablation, monkeypatch):
    report, _ = ablation

    before = json.loads((report.output / "ablation.json").read_text())
    calls = []
    real_train = ab.train  # the loop's train, as the experiment calls it
    monkeypatch.setattr(ab, "train", lambda r, resume=None, **kw: calls.append(resume) or real_train(r, resume, **kw))
    lines: list[str] = []
    again = ab.ablate(recipe(report.output.parent), output=report.output, say=lines.append, mi_records=16)
    assert calls == [] and all("finished earlier, skipped" in line for line in lines)
    assert json.loads((report.output / "ablation.json").read_text()) == before == again.to_dict()
    # An arm killed during its step 2 (its step-1 checkpoint written, no arm.json) is resumed from step 1.
    dense = report.output / "dense"
    import shutil

    shutil.rmtree(dense)
    real_log_step = MetricsLogger.log_step

    def crash(self, step, *args, **kwargs):
        record = real_log_step(self, step, *args, **kwargs)
        if step == 2:
            raise KeyboardInterrupt
        return record

    with monkeypatch.context() as patch:
        patch.setattr(MetricsLogger, "log_step", crash)
        with pytest.raises(KeyboardInterrupt):
            ab.ablate(recipe(report.output.parent), output=report.output, mi_records=16)
    assert not (dense / "arm.json").exists() and (dense / "checkpoints" / "step-1").is_dir()
    calls.clear()
    lines.clear()
    ab.ablate(recipe(report.output.parent), output=report.output, say=lines.append, mi_records=16)
    assert calls == [dense] and lines[-2] == f"arm dense: resuming in {dense}"
    resumed = json.loads((dense / "arm.json").read_text())
    assert resumed["steps"] == 2 and resumed["curve"] == before["arms"]["dense"]["curve"]  # exact resume


def test_a_finished_arm_from_another_recipe_is_not_reused(ablation):
    report, _ = ablation
    changed = recipe(report.output.parent, seed=7)
    with pytest.raises(ConfigError, match="arm moe was trained from another recipe.*training.seed"):
        ab.ablate(changed, arms="moe", output=report.output)


def test_routing_specialisation_is_measured_with_the_model_as_trained(ablation):
    """The routing the MI counts is the loaded model's own top-k (recomputed here token by token)."""
    report, _ = ablation
    import entrenar
    from entrenar.data import tokenize_records
    from entrenar.models.moe import moe_blocks, router_of

    model, tok = entrenar.load(report.output / "moe" / "model", dtype="float32", device="cpu")
    records = ab.heldout_records(recipe(), 4)
    spec = ab.routing_specialisation(report.output / "moe" / "model", recipe(), 4)
    examples, _ = tokenize_records(records, tok, 32, train_on="completion")
    want = {layer: [[0] * 4 for _ in range(4)] for layer, _ in moe_blocks(model)}
    for x, r in zip(examples, records):
        seen = {}
        hooks = [router_of(b).register_forward_hook(
                     lambda m, i, o, layer=layer, seen=seen: seen.__setitem__(layer, o[2]))
                 for layer, b in moe_blocks(model)]
        with torch.no_grad():
            model(torch.tensor([x.input_ids]))  # one record alone: no padding
        for h in hooks:
            h.remove()
        for layer, chosen in seen.items():
            for e in chosen.flatten().tolist():
                want[layer][r["task"]][e] += 1
    assert {int(k): v["all"]["table"] for k, v in spec["layers"].items()} == want


def test_the_sigmoid_arm_bias_rate_is_the_option_else_the_recipe_else_the_default(tmp_path):
    r = recipe(tmp_path)
    with_rate = Recipe.from_dict({**r.to_dict(), "moe": {**r.to_dict()["moe"], "bias_update_rate": 0.01}})
    assert ab.arm_recipe(with_rate, "moe-sigmoid", tmp_path).moe.bias_update_rate == 0.01
    assert ab.arm_recipe(with_rate, "moe-sigmoid", tmp_path, bias_update_rate=0.002).moe.bias_update_rate == 0.002
    assert ab.arm_recipe(r, "moe-sigmoid", tmp_path).moe.bias_update_rate == ab.BIAS_UPDATE_RATE


def test_a_finished_arm_continues_when_only_its_length_changed(ablation):
    report, _ = ablation
    lines: list[str] = []
    longer = recipe(report.output.parent, max_steps=3)
    out = report.output.parent / "longer"
    import shutil

    shutil.copytree(report.output / "moe", out / "moe")  # a copy: the shared fixture's arms stay as they are
    got = ab.ablate(longer, arms="moe", output=out, say=lines.append, mi_records=4)
    assert lines[0].startswith("arm moe: finished earlier; continuing it (training.max_steps: 2 -> 3)")
    assert lines[1] == f"arm moe: resuming in {out / 'moe'}"
    assert got.arms["moe"]["steps"] == 3 and got.arms["moe"]["curve"][:2] == report.arms["moe"]["curve"]


def test_without_matplotlib_the_report_is_written_and_says_why_there_is_no_plot(ablation, monkeypatch, tmp_path):
    import sys

    report, _ = ablation
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import fails as if not installed
    copy = ab.Ablation(tmp_path, report.arms, report.match, report.setup)
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        files = ab.write_report(copy)
    assert [f.name for f in files] == ["ablation.json", "ablation.md"] and not (tmp_path / "ablation_loss.png").exists()
    text = (tmp_path / "ablation.md").read_text()
    assert "Note: no plot: matplotlib is not installed (pip install 'entrenar[plot]')." in text


def test_an_epochs_recipe_is_described_by_its_epochs_not_none_steps():
    from entrenar.experiments.ablate import _length

    assert _length({"max_steps": None, "epochs": 2.0}) == "2 epoch(s)"
    assert _length({"max_steps": 300, "epochs": None}) == "300 steps"
