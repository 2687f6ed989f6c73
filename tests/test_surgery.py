"""entrenar.models.surgery: which layers a target_modules spec selects (checked against PEFT), and module swaps."""

from __future__ import annotations

import pytest
from torch import nn

import conftest
from entrenar.errors import AdapterError, ModelError
from entrenar.models.surgery import find_linears, is_linear, named_linears, replace_module

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def tiny_llama() -> nn.Module:
    return conftest.tiny_llama()


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return tiny_llama()


def peft_selection(model: nn.Module, target_modules) -> list[str]:
    """The layers PEFT itself wraps for ``target_modules`` (the reference)."""
    wrapped = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=target_modules))
    prefix = "base_model.model."
    return [name[len(prefix) :] for name, m in wrapped.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]


@pytest.mark.parametrize(
    "targets",
    [
        ["q_proj", "v_proj"],
        ["model.layers.1.mlp.down_proj", "k_proj"],
        r".*\.0\.mlp\.(gate|up)_proj",
        "all-linear",
    ],
    ids=["names", "full-name", "regex", "all-linear"],
)
def test_selection_matches_peft(llama, targets):
    assert find_linears(llama, targets) == peft_selection(llama, targets)


def test_all_linear_skips_only_the_output_head(llama):
    found = find_linears(llama, "all-linear")
    assert "lm_head" not in found
    assert len(found) == 2 * 7  # q k v o gate up down per layer
    assert set(found) | {"lm_head"} == {name for name, _ in named_linears(llama)}


class _PlainLM(nn.Module):
    """Not a transformers model: the head is found by its name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(2))
        self.lm_head = nn.Linear(8, 10)


class _HeadByAccessor(_PlainLM):
    """The head is whatever get_output_embeddings() returns, whatever its name."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 10)

    def get_output_embeddings(self) -> nn.Module:
        return self.out


def test_all_linear_on_plain_modules():
    assert find_linears(_PlainLM(), "all-linear") == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
    assert "out" not in find_linears(_HeadByAccessor(), "all-linear")


def test_pattern_matching_nothing_names_patterns_and_layers(llama):
    with pytest.raises(AdapterError) as err:
        find_linears(llama, ["query", "value"])
    message = str(err.value)
    assert "['query', 'value']" in message
    assert "model.layers.0.self_attn.q_proj" in message


def test_strict_rejects_a_typo_among_good_names(llama):
    with pytest.raises(AdapterError, match="v_prj"):
        find_linears(llama, ["q_proj", "v_prj"])
    # PEFT's rule (used when loading others' adapters): only the whole list must match.
    assert find_linears(llama, ["q_proj", "v_prj"], strict=False) == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
    ]


def test_pattern_on_a_non_linear_module_is_an_error(llama):
    with pytest.raises(AdapterError, match=r"'model\.layers\.0\.mlp', a LlamaMLP"):
        find_linears(llama, ["mlp"])


def test_bad_regex_and_bad_lists(llama):
    with pytest.raises(AdapterError, match="regular expression"):
        find_linears(llama, "q_proj(")
    with pytest.raises(AdapterError, match="non-empty list"):
        find_linears(llama, [])


class _PackedLinear(nn.Module):
    """A stand-in for a quantized linear that does not subclass nn.Linear but holds one inside."""

    linear_like = True

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)


def test_linear_like_modules_are_targets_and_leaves():
    model = nn.Sequential(_PackedLinear(), nn.Linear(8, 8))
    assert is_linear(model[0]) and not is_linear(nn.ReLU())
    assert find_linears(model, "all-linear") == ["0", "1"]  # never "0.inner"
    assert find_linears(model, r".*") == ["0", "1"]


def test_replace_module_inside_module_list():
    model = tiny_llama()
    name = "model.layers.1.mlp.up_proj"
    old = model.get_submodule(name)
    new = nn.Linear(64, 128, bias=False)
    assert replace_module(model, name, new) is old
    assert model.get_submodule(name) is new
    assert model.model.layers[1].mlp.up_proj is new
    assert any(p is new.weight for p in model.parameters())


def test_replace_module_errors_name_the_module(llama):
    with pytest.raises(ModelError, match="model.layers.0.self_attn.x_proj"):
        replace_module(llama, "model.layers.0.self_attn.x_proj", nn.Identity())
    with pytest.raises(ModelError, match="no module 'model.blocks'"):
        replace_module(llama, "model.blocks.q_proj", nn.Identity())
    with pytest.raises(ModelError):
        replace_module(llama, "", nn.Identity())
