"""``entrenar inspect RECIPE`` prints the longest sequence (batch 1) whose plan's memory estimate fits the GPU."""

from __future__ import annotations

import dataclasses
import re

from cli_helpers import run_cli

from entrenar.train.memory import GiB


def test_inspect_recipe_prints_the_longest_context_its_plan_fits(capsys, tmp_path):
    from entrenar.config import load_recipe
    from entrenar.train.plan import plan_for

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    recipe_file = tmp_path / "long.yaml"
    recipe_file.write_text(
        "model:\n  init: random\n  dtype: bfloat16\n  config: {model_type: llama, hidden_size: 256,"
        " num_hidden_layers: 4,"
        " num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 1024, vocab_size: 1000,"
        " max_position_embeddings: 131072}\n"
        f"data: {{train: {data}, seq_len: 1024, packing: false}}\nlora: {{r: 8}}\n"
        "training: {batch_size: 1, precision: bf16, activation_checkpointing: true, offload_activations: true,"
        " tiled_mlp: 512, cuda_graphs: false}\n"
        f"output: {{dir: {tmp_path / 'run'}}}\n")
    code, out, _ = run_cli(capsys, "inspect", recipe_file, "--device", "cuda", "--gpu-memory", "2")
    assert code == 0
    found = re.search(r"longest context +([\d,]+) tokens in one row \(batch 1\) fit 2\.00 GiB", out)
    assert found, out
    longest = int(found.group(1).replace(",", ""))
    recipe = load_recipe(recipe_file)

    def total(seq_len: int) -> float:
        row = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, seq_len=seq_len))
        return plan_for(row, "cuda", 1, 2.0)[0].memory.total

    assert total(longest) <= 2 * GiB < total(longest + 1)


def _recipe(tmp_path, training: str, packing: bool = True, lora: str = "{r: 4}"):
    from entrenar.config import load_recipe

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    path = tmp_path / "r.yaml"
    path.write_text("model:\n  init: random\n  config: {model_type: llama, hidden_size: 64, num_hidden_layers: 2,"
                    " num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 128, vocab_size: 300}\n"
                    f"data: {{train: {data}, seq_len: 64, packing: {str(packing).lower()}}}\nlora: {lora}\n"
                    f"training: {training}\noutput: {{dir: {tmp_path / 'run'}}}\n")
    return load_recipe(path)


def test_tiled_mlp_is_refused_with_compile_and_graphs_and_turns_auto_graphs_off(tmp_path):
    """Tiled MLP: refused with compile; under CUDA graphs only without LoRA dropout (the tiles' rerun would restore
    the generator's state through the host); auto leaves graphs off (not yet captured on a GPU)."""
    import pytest

    from entrenar.errors import ConfigError
    from entrenar.train.plan import plan_for

    with pytest.raises(ConfigError, match=r"training.tiled_mlp: .* turn off compile"):
        plan_for(_recipe(tmp_path, "{tiled_mlp: 32, compile: true}"), "cpu")
    with pytest.raises(ConfigError, match=r"training.tiled_mlp: .* turn off cuda_graphs \(or set lora.dropout: 0"):
        plan_for(_recipe(tmp_path, "{tiled_mlp: 32, cuda_graphs: true, precision: bf16}", lora="{r: 4, dropout: 0.1}"),
                 "cuda")
    assert plan_for(_recipe(tmp_path, "{tiled_mlp: 32, cuda_graphs: true, precision: bf16}",
                            lora="{r: 4, dropout: 0.0}"), "cuda")[0].cuda_graphs
    # auto: a LoRA run on packed rows on one GPU replays graphs, unless its MLP is tiled
    graphs = plan_for(_recipe(tmp_path, "{precision: bf16}"), "cuda")[0]
    tiled = plan_for(_recipe(tmp_path, "{precision: bf16, tiled_mlp: 32}"), "cuda")[0]
    assert graphs.cuda_graphs and not tiled.cuda_graphs
    assert ("training.tiled_mlp", "32 tokens a tile (as set): each MLP forward runs twice, its activations one "
            "tile's") in tiled.reasons
