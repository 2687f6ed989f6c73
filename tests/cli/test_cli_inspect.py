"""``entrenar inspect``: architecture and parameter counts against transformers and PEFT, memory against
``entrenar.train.memory``, the same answer for a folder and its GGUF file, and errors that name the file."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run_cli

from entrenar.kernels.fused_linear_ce import fused_loss_chunk
from entrenar.models.hf import read_config
from entrenar.train.memory import estimate_training_memory, format_estimates


def inspect_json(capsys, *argv) -> dict:
    code, out, _ = run_cli(capsys, "inspect", *argv, "--json")
    assert code == 0
    return json.loads(out)


def test_architecture_and_parameters_match_transformers_and_peft(capsys, hf_folder):
    from peft import LoraConfig, get_peft_model

    folder, hf_model = hf_folder("qwen3")
    report = inspect_json(capsys, folder, "--lora-r", 4, "--lora-targets", "q_proj,v_proj")
    c = hf_model.config
    arch = report["architecture"]
    assert (arch["model_type"], arch["num_layers"], arch["hidden_size"], arch["intermediate_size"]) == (
        "qwen3", c.num_hidden_layers, c.hidden_size, c.intermediate_size)
    assert (arch["num_heads"], arch["num_kv_heads"], arch["head_dim"], arch["vocab_size"]) == (
        c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size)
    assert arch["qk_norm"] is True and arch["tie_word_embeddings"] == c.tie_word_embeddings
    assert report["parameters"]["total"] == sum(p.numel() for p in hf_model.parameters())
    peft_model = get_peft_model(hf_model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert report["parameters"]["lora_trainable"] == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def test_rope_scaling_tied_embeddings_and_biases_are_reported(capsys, hf_folder):
    folder, _ = hf_folder("llama3-scaled-tied-bias")
    arch = inspect_json(capsys, folder)["architecture"]
    assert arch["rope_theta"] == 500000.0 and arch["tie_word_embeddings"] is True
    assert arch["rope_scaling"]["rope_type"] == "llama3" and arch["rope_scaling"]["factor"] == 8.0
    code, out, _ = run_cli(capsys, "inspect", folder)
    assert code == 0
    assert "theta 500000, scaling llama3 (factor=8.0, " in out
    assert "tied embed.   yes" in out and "qkv_bias, o_bias, mlp_bias" in out


def test_memory_equals_estimate_training_memory(capsys, hf_folder):
    folder, _ = hf_folder("llama")
    argv = [folder, "--batch-size", 2, "--seq-len", 64, "--lora-r", 8, "--lora-targets", "q_proj,v_proj",
            "--dtype", "fp32", "--checkpointing"]
    config = read_config(folder)
    expected = [estimate_training_memory(config, method, batch_size=2, seq_len=64, dtype_bytes=4, lora_r=8,
                                         lora_targets=["q_proj", "v_proj"], activation_checkpointing=True)
                for method in ("full", "lora", "qlora")]
    report = inspect_json(capsys, *argv)
    assert report["memory"]["estimates"] == {e.method: e.as_dict() for e in expected}
    code, out, _ = run_cli(capsys, "inspect", *argv)
    assert code == 0
    assert out.endswith(format_estimates(expected) + "\n")


def test_offload_and_kernels_flags_reach_the_estimate(capsys, hf_folder):
    folder, _ = hf_folder("llama")
    chunk = fused_loss_chunk(read_config(folder).vocab_size)
    expected = estimate_training_memory(read_config(folder), "qlora", activation_checkpointing=True,
                                        offload_activations=True, fused_loss_chunk=chunk, kernels=True)
    report = inspect_json(capsys, folder, "--checkpointing", "--offload", "--kernels")
    assert report["memory"]["estimates"]["qlora"] == expected.as_dict()
    assert expected.total < estimate_training_memory(read_config(folder), "qlora", activation_checkpointing=True).total
    # Some layers checkpointed, the others' activations offloaded too: less than either alone.
    some = inspect_json(capsys, folder, "--checkpointing", "1", "--offload")["memory"]["estimates"]["qlora"]
    assert some == estimate_training_memory(read_config(folder), "qlora", activation_checkpointing=1,
                                            offload_activations=True).as_dict()
    assert some["total"] < estimate_training_memory(read_config(folder), "qlora", activation_checkpointing=1).total
    code, _, err = run_cli(capsys, "inspect", folder, "--checkpointing", "99")
    assert code == 2 and "--checkpointing: cannot checkpoint 99 layers of a 2-layer model" in err


def test_offload_embeddings_flag_reaches_the_estimate(capsys, hf_folder):
    folder, _ = hf_folder("llama")
    expected = estimate_training_memory(read_config(folder), "qlora", offload_embeddings=True)
    report = inspect_json(capsys, folder, "--offload-embeddings")
    assert report["memory"]["estimates"]["qlora"] == expected.as_dict()
    assert report["memory"]["estimates"]["full"] == estimate_training_memory(read_config(folder), "full").as_dict()
    assert expected.weights < estimate_training_memory(read_config(folder), "qlora").weights


def test_defaults_are_the_library_defaults(capsys, hf_folder):
    folder, _ = hf_folder("mistral")
    report = inspect_json(capsys, folder)
    assert report["memory"]["estimates"]["qlora"] == estimate_training_memory(read_config(folder), "qlora").as_dict()


def test_a_gguf_file_reads_as_its_folder(capsys, hf_folder, tmp_path):
    from gguf_fixtures import write_gguf

    folder, hf_model = hf_folder("qwen2")
    path = write_gguf(tmp_path / "tiny.gguf", hf_model)
    from_folder, from_gguf = inspect_json(capsys, folder), inspect_json(capsys, path)
    assert from_gguf["model"] == str(path)
    for key in ("architecture", "parameters", "memory"):
        assert from_gguf[key] == from_folder[key]


def test_missing_model_names_the_path(capsys, tmp_path):
    assert run_cli(capsys, "inspect", tmp_path / "nowhere")[::2] == (
        2, f"error: {tmp_path / 'nowhere'}: no such model folder or .gguf file\n")
    assert run_cli(capsys, "inspect", tmp_path / "nowhere.gguf")[::2] == (
        2, f"error: {tmp_path / 'nowhere.gguf'}: no such GGUF file\n")


def test_bad_config_json_names_the_file_and_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}\n')
    code, _, err = run_cli(capsys, "inspect", tmp_path)
    assert code == 2
    assert err.startswith(f"error: {tmp_path / 'config.json'} line 3: invalid JSON") and err.count("\n") == 1


def test_unknown_family_names_the_file_and_family(capsys, hf_folder):
    folder, _ = hf_folder("llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    code, _, err = run_cli(capsys, "inspect", folder)
    assert code == 2
    assert err.startswith(f"error: {folder / 'config.json'}: unknown model family 'gpt2'")


@pytest.mark.parametrize("targets", ["q_proj,lm_head", "q,v", ","])
def test_unknown_lora_target_is_refused(capsys, hf_folder, targets):
    folder, _ = hf_folder("llama")
    code, _, err = run_cli(capsys, "inspect", folder, "--lora-targets", targets)
    assert code == 2
    assert err.startswith("error: --lora-targets: unknown projection") and "q_proj, k_proj" in err


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_moe_total_active_and_expert_adapters_match_transformers_and_peft(capsys, hf_folder, family):
    from peft import LoraConfig, get_peft_model

    folder, hf_model = hf_folder(family)
    report = inspect_json(capsys, folder, "--lora-r", 2, "--lora-targets", "q_proj", "--lora-experts")
    params = report["parameters"]
    assert params["total"] == sum(p.numel() for p in hf_model.parameters())
    experts = [m for n, m in hf_model.named_modules() if n.endswith("mlp.experts")]
    per_expert = sum(m.gate_up_proj[0].numel() + m.down_proj[0].numel() for m in experts)
    k, e = hf_model.config.num_experts_per_tok, experts[0].gate_up_proj.shape[0]
    assert params["total"] - params["active_per_token"] == (e - k) * per_expert
    assert report["architecture"]["num_experts"] == e
    peft_model = get_peft_model(hf_model, LoraConfig(r=2, target_modules=["q_proj"], target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    assert params["lora_trainable"] == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    code, out, _ = run_cli(capsys, "inspect", folder)
    assert code == 0 and "per token" in out and "experts" in out


def test_cpu_flag_estimates_the_cpu_process(capsys, hf_folder):
    folder, _ = hf_folder("llama")
    expected = estimate_training_memory(read_config(folder), "lora", cpu=True, param_bytes=4)
    assert inspect_json(capsys, folder, "--cpu")["memory"]["estimates"]["lora"] == expected.as_dict()
    assert expected.runtime > 0 and expected.casts > 0  # fp32 weights under bf16 autocast
    code, out, _ = run_cli(capsys, "inspect", folder, "--cpu")
    assert code == 0 and "runtime" in out and "resident memory of a CPU process" in out


def test_nproc_and_parallel_give_the_per_device_estimate(capsys, hf_folder):
    from entrenar.train.memory import per_device

    folder, _ = hf_folder("llama")
    config = read_config(folder)
    report = inspect_json(capsys, folder, "--nproc", "4", "--parallel", "fsdp")
    expected = per_device(estimate_training_memory(config, "full"), config, 4, "fsdp", dtype_bytes=2)
    assert report["memory"]["estimates"]["full"] == expected.as_dict()
    assert expected.total < estimate_training_memory(config, "full").total
    assert (report["memory"]["nproc"], report["memory"]["parallel"]) == (4, "fsdp")


def test_a_recipe_prints_the_plan_the_dry_run_prints_without_reading_weights(capsys, workspace):
    """``entrenar inspect RECIPE`` is the plan of ``--dry-run`` without loading anything: each decision with its
    rule and the memory estimate, for this machine or for a GPU it lacks."""
    from entrenar.config import load_recipe
    from entrenar.distributed.world import World
    from entrenar.train.dry_run import plan_lines
    from entrenar.train.loop import train
    from entrenar.train.plan import plan_run

    recipe_file = workspace / "r.yaml"
    recipe_file.write_text(f"model: {{path: {workspace / 'model'}, device: cpu}}\n"
                           f"data: {{train: {workspace / 'train.jsonl'}, seq_len: 32}}\nlora: {{r: 4}}\n"
                           f"output: {{dir: {workspace / 'run'}}}\n")
    dry = train(load_recipe(recipe_file), dry_run=True, progress=False).summary
    (workspace / "model" / "model.safetensors").rename(workspace / "weights.bak")  # inspect reads config.json only
    code, out, _ = run_cli(capsys, "inspect", recipe_file)
    assert code == 0
    planned = plan_lines(plan_run(load_recipe(recipe_file), __import__("torch").device("cpu"), World(),
                                  read_config(workspace / "model")))
    # The memory decision reads the machine's free memory at each call, which other processes move between them.
    planned = [line for line in planned if "GiB available" not in line]
    assert all(line in out for line in planned) and all(line in dry for line in planned)
    code, out, _ = run_cli(capsys, "inspect", recipe_file, "--device", "cuda", "--nproc", "2", "--gpu-memory", "1")
    assert code == 0 and "training.parallel             ddp (auto: a replica needs" in out


def test_seq_len_beyond_the_models_context_is_noted(capsys, hf_folder):
    """--seq-len above max_position_embeddings (transformers' config) gets the note training gives; above 8x,
    the refusal training gives, as a note; within the context, nothing."""
    folder, hf_model = hf_folder("llama")
    context = hf_model.config.max_position_embeddings
    code, out, _ = run_cli(capsys, "inspect", folder, "--seq-len", context + 1)
    assert code == 0
    assert out.splitlines()[-1] == (f"note: --seq-len={context + 1:,} is beyond the context of {folder} "
                                    f"({context:,} tokens, max_position_embeddings): positions past it are "
                                    "extrapolated")
    assert inspect_json(capsys, folder, "--seq-len", 8 * context + 1)["notes"][0].endswith(
        f"use at most {8 * context:,}; entrenar train refuses this length")
    code, out, _ = run_cli(capsys, "inspect", folder, "--seq-len", context)
    assert "note:" not in out and inspect_json(capsys, folder, "--seq-len", context)["notes"] == []


def test_qat_rows_and_the_quantized_size(capsys, hf_folder):
    """--qat adds QAT and LoRA-QAT rows (as estimate_training_memory gives them) and the exported model's size."""
    from entrenar.train.memory import quantized_model_bytes

    folder, _ = hf_folder("llama")
    report = inspect_json(capsys, folder, "--qat", "3", "--qat-group-size", "16")
    config = read_config(folder)
    for method in ("qat", "lora-qat"):
        expected = estimate_training_memory(config, method, seq_len=2048, qat_group_size=16).as_dict()
        assert report["memory"]["estimates"][method] == expected
    assert report["quantized_model_bytes"] == quantized_model_bytes(config, 3, 16, 2)
    code, out, _ = run_cli(capsys, "inspect", folder, "--qat", "3")
    assert code == 0 and "lora-qat" in out and "the 3-bit model QAT and LoRA-QAT export: " in out
    code, _, err = run_cli(capsys, "inspect", folder, "--qat", "9")
    assert code == 2 and "--qat: a bit width in [2, 8], got 9" in err


def test_a_lora_qat_recipe_is_planned_as_lora_qat(capsys, workspace):
    recipe_file = workspace / "r.yaml"
    recipe_file.write_text(f"model: {{path: {workspace / 'model'}, device: cpu}}\n"
                           f"data: {{train: {workspace / 'train.jsonl'}, seq_len: 32}}\nlora: {{r: 4}}\n"
                           "qat: {bits: 3}\n")
    code, out, _ = run_cli(capsys, "inspect", recipe_file)
    assert code == 0 and ": lora-qat on cpu" in out
    assert "of it fake quantization" in out and "quantized model" in out and "3-bit codes" in out


def test_context_parallel_gives_each_device_its_slice_of_the_sequence(capsys, hf_folder):
    """--context-parallel CP: the estimate of a sequence of seq_len / CP tokens (activations divided, weights
    not), refused where CP does not divide the processes or the heads."""
    folder, _ = hf_folder("llama")
    config = read_config(folder)
    report = inspect_json(capsys, folder, "--nproc", "2", "--context-parallel", "2", "--seq-len", "4096")
    expected = estimate_training_memory(config, "lora", seq_len=2048)
    whole = estimate_training_memory(config, "lora", seq_len=4096)
    assert report["memory"]["estimates"]["lora"] == expected.as_dict()
    assert expected.activations < whole.activations and expected.weights == whole.weights
    assert (report["memory"]["seq_len"], report["memory"]["context_parallel"]) == (4096, 2)
    code, _, err = run_cli(capsys, "inspect", folder, "--nproc", "3", "--context-parallel", "2")
    assert code == 2 and "--context-parallel: 2 must divide --nproc (3)" in err
