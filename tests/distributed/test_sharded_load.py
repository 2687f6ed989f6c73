"""An FSDP run's model load: rank 0 reads the weights, rank 1 builds on the meta device and receives only its
shards, and the weights (and the adapters' random start) are those of a plain one-process load."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_fixtures import write_recipe  # noqa: E402
from workers import sharded_load_worker  # noqa: E402

from entrenar import quickstart, tasks  # noqa: E402
from entrenar.config import load_recipe  # noqa: E402
from entrenar.distributed.launch import launch_function  # noqa: E402
from entrenar.models.config import ModelConfig  # noqa: E402
from entrenar.models.hf import save_hf  # noqa: E402
from entrenar.models.transformer import Transformer  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_rank_1_builds_on_meta_holds_about_half_and_gets_a_plain_loads_weights(tmp_path):
    from conftest import make_workspace

    ws = make_workspace(tmp_path)
    # A model big enough for its copy to show in a process's peak memory (72 MiB of fp32 weights, tied embeddings).
    tokenizer = quickstart.build_tokenizer()
    config = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=512, intermediate_size=1536, num_layers=6,
                         num_heads=8, num_kv_heads=4, model_type="llama", tie_word_embeddings=True)
    torch.manual_seed(0)
    big = Transformer(config)
    big.reset_parameters()
    model_bytes = sum(p.numel() * 4 for p in big.parameters())
    save_hf(big, ws / "model")  # a new folder: the tokenizer again
    tokenizer.save(ws / "model")
    del big
    recipe = write_recipe(ws, "lora")

    # Spawned, as torchrun starts workers: a forked child's resident memory counts pages it shares with the parent
    # (and reuses the parent's freed ones), which made the growth read 0.26x to 0.98x the model by test order.
    results = launch_function(sharded_load_worker, (recipe, []), start_method="spawn", shutdown_timeout=2,
                              nproc_per_node=2)
    r = load_recipe(recipe)
    torch.manual_seed(r.training.seed)
    from entrenar.train.prepare import build_model

    plain, _ = build_model(r, tasks.for_recipe(r), "float32", torch.device("cpu"), None)
    expected = dict(plain.named_parameters())
    assert [results[0]["built_on"], results[1]["built_on"]] == ["cpu", "meta"]
    got = results[1]["weights"]  # rank 1's shards (from rank 0's broadcast), gathered whole
    assert got.keys() == expected.keys() and any("lora_A" in name for name in got)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor.detach(), rtol=0, atol=0, msg=name)
    trainable = sorted(name for name, p in plain.named_parameters() if p.requires_grad)
    assert results[1]["gathered_for_adapter"] == trainable  # the adapter's output gathers no frozen base
    for rank in (0, 1):  # RoPE's buffer (not in a state dict) and the generator, as after a plain load
        torch.testing.assert_close(results[rank]["inv_freq"], plain.inv_freq, rtol=0, atol=0)
        assert torch.equal(results[rank]["rng"], torch.get_rng_state())
    # Rank 0 holds a whole load (measured: 2.0x the model's fp32 size, as when every rank loaded whole); rank 1
    # its half of the shards and a tensor in flight (measured: 0.71x), never a whole copy.
    assert results[0]["grown"] > 0.9 * model_bytes
    assert results[1]["grown"] < 0.9 * model_bytes, (results[1]["grown"], model_bytes)
