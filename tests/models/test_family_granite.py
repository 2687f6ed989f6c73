"""Granite against transformers and peft: embedding, residual and attention multipliers, logits divided by
logits_scaling (in the fused loss too)."""

from __future__ import annotations

import pytest
import torch
from family_checks import (
    check_adapters_cross_load,
    check_batched_generation,
    check_dry_run_notes,
    check_gguf_export_round_trip,
    check_gguf_load,
    check_inspect,
    check_kernels_keep_logits,
    check_logits,
    check_lora_step_matches_peft,
    check_packed_equals_documents,
    check_padded_batch,
    check_qlora_base,
    check_save_round_trip,
    make_checkpoint,
)

from entrenar.kernels.fused_linear_ce import fused_linear_cross_entropy
from entrenar.models.hf import load_hf
from entrenar.models.loss import chunked_cross_entropy, token_cross_entropy

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             attention_bias=True, mlp_bias=True, embedding_multiplier=6.0, residual_multiplier=0.3,
             attention_multiplier=0.05, logits_scaling=4.0, pad_token_id=0, eos_token_id=2)
TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("granite") / "model", "GraniteConfig", "GraniteForCausalLM",
                           **SHAPE)


def test_multipliers_are_read(granite):
    config = load_hf(granite[0]).config
    assert (config.embedding_multiplier, config.residual_multiplier, config.attention_multiplier,
            config.logits_scaling) == (6.0, 0.3, 0.05, 4.0)


def test_logits_match_transformers(granite):
    folder, ref = granite
    model = load_hf(folder).eval()
    check_logits(model, ref, 12)
    check_padded_batch(model, ref)
    check_packed_equals_documents(model)


def test_save_in_granite_layout(granite, tmp_path):
    folder, ref = granite
    check_save_round_trip(folder, ref, tmp_path / "saved")


def test_lora_step_matches_peft(granite):
    folder, ref = granite
    check_lora_step_matches_peft(folder, ref, TARGETS)


def test_adapters_load_both_ways(granite, tmp_path):
    folder, ref = granite
    check_adapters_cross_load(folder, ref, TARGETS, tmp_path)


def test_qlora_base(granite):
    check_qlora_base(granite[0])


def test_kernels_keep_the_multipliers(granite):
    check_kernels_keep_logits(granite[0])


@pytest.mark.parametrize("loss", [chunked_cross_entropy, fused_linear_cross_entropy])
def test_fused_loss_divides_the_logits(granite, loss):
    """The chunked loss and the fused kernel (its PyTorch path here) with logits_scaling: transformers' loss and
    the gradients of the plain loss on the model's (divided) logits."""
    folder, ref = granite
    model = load_hf(folder)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(8))
    labels = ids.clone()
    labels[:, :3] = -100
    hidden = model.hidden_states(ids).detach().requires_grad_()
    loss_sum, n = loss(hidden, model.lm_head.weight, labels, 5, logits_scaling=model.config.logits_scaling)
    with torch.no_grad():
        expected = ref(ids, labels=labels).loss
    torch.testing.assert_close(loss_sum / n, expected, atol=1e-5, rtol=0)
    loss_sum.backward()
    plain_hidden = hidden.detach().requires_grad_()
    token_cross_entropy(model.lm_head(plain_hidden) / model.config.logits_scaling, labels)[0].backward()
    torch.testing.assert_close(hidden.grad, plain_hidden.grad, atol=1e-6, rtol=1e-5)


def test_training_task_passes_the_scaling_to_the_fused_loss(granite):
    """The causal-LM task with kernels (the fused loss) gives the loss of the model's own logits."""
    from types import SimpleNamespace

    from entrenar.tasks.causal_lm import CausalLMTask

    model = load_hf(granite[0])
    task = CausalLMTask(recipe=SimpleNamespace(), kernels=True)
    task.prepare(model)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(9))
    batch = {"input_ids": ids, "position_ids": torch.arange(12).expand(2, 12), "labels": ids}
    with torch.no_grad():
        fused = task.loss_sum(model, batch)
        torch.testing.assert_close(fused, token_cross_entropy(model(ids), ids)[0], atol=1e-4, rtol=1e-6)


def test_gguf_as_llama_cpp_writes_granite_loads_with_transformers_logits(tmp_path):
    """llama.cpp's granite layout: Llama's tensors with q/k rows permuted, the multipliers as granite.*_scale."""
    extra_kv = {"embedding_scale": ("float32", 6.0), "residual_scale": ("float32", 0.3),
                "attention.scale": ("float32", 0.05), "logit_scale": ("float32", 4.0)}
    model, tokenizer = check_gguf_load(tmp_path, "GraniteConfig", "GraniteForCausalLM", SHAPE, extra_kv)
    assert model.config.logits_scaling == 4.0
    check_gguf_export_round_trip(model, tokenizer, tmp_path)


def test_dry_run_says_what_the_kernels_do(granite, tmp_path):
    check_dry_run_notes(granite[0], tmp_path, "logits divided by 4 inside the fused loss",
                        "multipliers: applied around the fused nodes")


def test_inspect_counts_parameters_as_transformers_and_peft(granite, capsys):
    check_inspect(capsys, granite[0], granite[1], ["q_proj", "v_proj", "up_proj"])


def test_batched_generation_matches_transformers(granite):
    """The embedding multiplier and the logits' scaling in the KV-cache sampler too, eager and on the static cache."""
    folder, ref = granite
    check_batched_generation(load_hf(folder).eval(), ref)
