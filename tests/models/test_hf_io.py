"""Hugging Face folders: load (single and sharded), save back for transformers, errors that name the tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from entrenar.errors import ModelError
from entrenar.models.config import ModelConfig
from entrenar.models.hf import load_hf, save_hf


@pytest.mark.parametrize("family", ["llama3-scaled-tied-bias", "qwen2", "qwen3", "mistral"])
def test_saved_folder_loads_in_transformers_with_same_logits(hf_folder, tmp_path, family):
    import transformers

    folder, _ = hf_folder(family)
    model = load_hf(folder)
    out = save_hf(model, tmp_path / "saved")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids), atol=1e-5, rtol=0)
    assert ModelConfig.from_hf(json.loads((out / "config.json").read_text())) == model.config


def test_sharded_save_and_load_round_trip(hf_folder, tmp_path):
    import transformers

    folder, _ = hf_folder("llama")
    model = load_hf(folder)
    out = save_hf(model, tmp_path / "sharded", max_shard_bytes=40_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    again = load_hf(out)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    ids = torch.randint(0, 128, (1, 8))
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, again(ids), atol=1e-5, rtol=0)


def test_save_over_existing_folder_replaces_it_whole(hf_folder, tmp_path):
    folder, _ = hf_folder("llama")
    model = load_hf(folder)
    target = tmp_path / "out"
    save_hf(model, target, max_shard_bytes=40_000)
    save_hf(model, target)  # now unsharded: no stale shards or index may remain
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def _rewrite(folder, fn):
    path = folder / "model.safetensors"
    state = load_file(str(path))
    fn(state)
    save_file(state, str(path), metadata={"format": "pt"})


def test_shape_mismatch_names_the_tensor(hf_folder):
    folder, _ = hf_folder("llama")
    _rewrite(folder, lambda s: s.__setitem__("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 3)))
    with pytest.raises(ModelError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(3, 3\).*\(128, 64\)"):
        load_hf(folder)


def test_missing_and_unexpected_tensors_are_named(hf_folder):
    folder, _ = hf_folder("llama")
    _rewrite(folder, lambda s: s.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ModelError, match=r"missing tensors model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_hf(folder)
    _rewrite(folder, lambda s: s.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 64))
             or s.__setitem__("vision.patch", torch.zeros(1)))
    with pytest.raises(ModelError, match=r"'vision\.patch' does not belong"):
        load_hf(folder)


def test_unknown_family_and_corrupt_files(hf_folder, tmp_path):
    folder, _ = hf_folder("llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox",
                                                    "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ModelError, match=r"unknown model family 'gpt_neox'.*supported: llama, mistral, qwen2, qwen3"):
        load_hf(folder)
    (folder / "config.json").write_text("{\n  \"model_type\": \"llama\",\n  oops\n}")
    with pytest.raises(ModelError, match=r"config\.json line 3: invalid JSON"):
        load_hf(folder)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ModelError, match=r"model\.safetensors: cannot read safetensors"):
        load_hf(folder)
    with pytest.raises(ModelError, match="no such model folder"):
        load_hf(tmp_path / "nowhere")


def test_empty_model_allocates_weights_once_in_the_target_dtype(monkeypatch):
    """Weights leave the meta device already in the load dtype: no fp32 copy that is cast afterwards."""
    from entrenar.models.hf import empty_model

    seen: list[torch.dtype] = []
    to_empty = torch.nn.Module.to_empty

    def spy(module, *args, **kwargs):
        seen.extend({p.dtype for p in module.parameters()})
        return to_empty(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to_empty", spy)
    config = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                         vocab_size=64)
    model = empty_model(config, torch.bfloat16, "cpu")
    assert seen == [torch.bfloat16]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_tied_table_is_allocated_once_when_the_model_leaves_the_meta_device():
    """to_empty makes a new parameter per module holding one: a table tied to the output head would exist twice
    until re-tied, at load the peak of a memory-matched Gemma-3-4B run (1.25 GiB more). It is allocated once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from entrenar.models.hf import empty_model

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.shapes: list[tuple[int, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.device.type != "meta":
                self.shapes.append(tuple(out.shape))
            return out

    config = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                         vocab_size=96, tie_word_embeddings=True)
    with Allocations() as allocations:
        model = empty_model(config, torch.bfloat16, "cpu")
    assert allocations.shapes.count((96, 32)) == 1
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)][-1] == "lm_head.weight"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tied", [False, True])
def test_load_peak_gpu_memory_is_one_copy_of_the_weights(hf_folder, tied):
    # tied: a 4 MiB table, nearly the whole model, that a second copy at load would show above the slack
    folder, _ = hf_folder("llama", **({"tie_word_embeddings": True, "vocab_size": 32768} if tied else {}))
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load_hf(folder, dtype=torch.bfloat16, device="cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert torch.cuda.max_memory_allocated() - before <= weights * 1.1 + 2**20


def test_header_tensors_give_each_tensor_its_stored_dtype_without_reading_data(tmp_path):
    """What a rank building on the meta device checks a file against: names, shapes and the dtypes on disk."""
    from safetensors.torch import save_file

    from entrenar.models.hf import header_tensors

    stored = {"codes": torch.zeros(4, 8, dtype=torch.uint8), "w": torch.zeros(2, 3, dtype=torch.bfloat16),
              "scale": torch.ones(5), "fp8": torch.zeros(3, dtype=torch.float8_e4m3fn),
              "idx": torch.zeros(2, dtype=torch.int64)}
    save_file(stored, str(tmp_path / "model.safetensors"))
    seen = {name: t for _, name, t in header_tensors([tmp_path / "model.safetensors"])}
    assert seen.keys() == stored.keys()
    for name, tensor in stored.items():
        assert seen[name].is_meta and seen[name].dtype == tensor.dtype and seen[name].shape == tensor.shape, name
