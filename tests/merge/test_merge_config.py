"""mergekit's YAML: what is read, how parameter values resolve, and what is refused (by name and line)."""

from __future__ import annotations

import pytest

from entrenar.errors import ConfigError
from entrenar.merge.config import evaluate_setting, load_config


def write(tmp_path, text):
    path = tmp_path / "merge.yaml"
    path.write_text(text)
    return path


def test_reads_a_mergekit_ties_config(tmp_path):
    cfg = load_config(write(tmp_path, """\
merge_method: ties
base_model: base
models:
  - model: a
    parameters: {weight: 0.5, density: 0.6}
  - model: base+adapter
    parameters:
      weight: [0.2, 0.8]
      density: [{filter: mlp, value: 0.7}, {value: 0.4}]
parameters: {normalize: false, lambda: 1.5, int8_mask: true}
dtype: bfloat16
out_dtype: float16
tokenizer_source: union
chat_template: chatml
"""))
    assert cfg.merge_method == "ties" and cfg.base_model.text == "base"
    assert [s.model.text for s in cfg.models] == ["a", "base+adapter"]
    assert str(cfg.models[1].model.adapter) == "adapter" and str(cfg.models[1].model.path) == "base"
    assert cfg.parameters == {"normalize": False, "lambda": 1.5, "int8_mask": True}
    assert (cfg.dtype, cfg.out_dtype, cfg.tokenizer_source, cfg.chat_template) == (
        "bfloat16", "float16", "union", "chatml")
    assert [r.text for r in cfg.references()] == ["base", "a", "base+adapter"]


def test_evaluate_setting_matches_mergekit_rules():
    assert evaluate_setting(0.3, "x", 0.9) == 0.3
    # gradient: [0, 1, 0.5] at t=0.75 -> between index 1 and 2 at frac 0.5
    assert evaluate_setting([0.0, 1.0, 0.5], "x", 0.75) == pytest.approx(0.75)
    assert evaluate_setting([0.0, 1.0, 0.5], "x", 1.0) == 0.5
    cond = [{"filter": "self_attn", "value": [0.0, 1.0]}, {"filter": "mlp", "value": 0.9}, {"value": 0.5}]
    assert evaluate_setting(cond, "model.layers.3.self_attn.q_proj.weight", 0.25) == 0.25
    assert evaluate_setting(cond, "model.layers.3.mlp.up_proj.weight", 0.25) == 0.9
    assert evaluate_setting(cond, "model.norm.weight", 0.25) == 0.5
    assert evaluate_setting([{"filter": "mlp", "value": 1}], "model.norm.weight", 0) is None


def test_slices_for_a_frankenmerge(tmp_path):
    cfg = load_config(write(tmp_path, """\
merge_method: passthrough
slices:
  - sources: [{model: a, layer_range: [0, 2]}]
  - sources:
      - model: b
        layer_range: [1, 2]
        parameters: {scale: [{filter: o_proj, value: 0.0}, {value: 1.0}]}
"""))
    assert [s.sources[0].layer_range for s in cfg.slices] == [(0, 2), (1, 2)]


@pytest.mark.parametrize("text, message", [
    ("merge_method: ties\nbase_model: a\nmodels: [{model: b, parameters: {weight: 1}}]\nmodules: {}\n",
     "line 4: 'modules'"),
    ("merge_method: ties\nbase_model: a\nmodels: [{model: b}]\nnormalise: true\n", "line 4: unknown key 'normalise'"),
    ("merge_method: tiez\nmodels: [{model: b}]\n", "line 1: unknown merge_method 'tiez'"),
    ("merge_method: ties\nbase_model: a\nmodels:\n  - model: b\n    parameters: {weight: 1, densty: 0.5}\n",
     "line 5: parameter 'densty' is not a per-model parameter of ties"),
    ("merge_method: linear\nmodels: [{model: b, parameters: {weight: 1}}]\nparameters: {lambda: 2}\n",
     "line 3: parameter 'lambda' is not a parameter of linear"),
    ("merge_method: ties\nmodels: [{model: b, parameters: {weight: 1}}]\n", "needs base_model"),
    ("merge_method: slerp\nbase_model: a\nmodels: [{model: a}, {model: b}]\n", "needs the parameter 't'"),
    ("merge_method: linear\nmodels: [{model: b, parameters: {weight: {x: 1}}}]\n", "needs 'value'"),
    ("merge_method: linear\nmodels: [{model: b}]\ndtype: int4\n", "line 3: dtype 'int4'"),
    ("merge_method: linear\nmodels: [{model: b}]\nslices: []\n", "exactly one of 'models' and 'slices'"),
    ("merge_method: linear\nmodels: [{model: b}]\ntokenizer: {source: union}\n", "line 3: 'tokenizer'"),
    ("merge_method: passthrough\nslices:\n  - sources: [{model: a, layer_range: [2, 1]}]\n", "layer_range"),
    ("merge_method: linear\nmodels: [{model: b}]\nmodels: [{model: c}]\n", "duplicate key 'models'"),
])
def test_refuses_what_it_does_not_support_by_name_and_line(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_malformed_yaml_names_the_line(tmp_path):
    with pytest.raises(ConfigError, match=r"merge.yaml line 3, column 1: malformed YAML"):
        load_config(write(tmp_path, "merge_method: linear\nmodels: [a\n"))
