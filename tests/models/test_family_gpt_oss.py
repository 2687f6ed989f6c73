"""gpt-oss against transformers: attention sinks, alternating sliding-window layers, YaRN, the router with a bias
and softmax over its top k, the clamped SwiGLU experts with biases, and MXFP4 expert weights dequantized on load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from family_checks import (
    check_inspect,
    check_logits_and_gradients,
    check_lora_step_matches_peft,
    check_packed_equals_documents,
    check_padded_batch,
    check_save_round_trip,
    honour_swiglu_config,
    save_family,
)
from safetensors.torch import load_file, save_file

from entrenar.errors import AdapterError
from entrenar.models import gpt_oss_layout
from entrenar.models.hf import load_hf, save_hf
from entrenar.models.moe import moe_blocks, set_experts_implementation
from entrenar.models.transformer import KVCache

GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=8,
               swiglu_limit=0.3, max_position_embeddings=256,
               rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0})


@pytest.fixture
def gpt_oss(tmp_path):
    # swiglu_limit 0.3: small enough that the clamps act on these weights (at 7 they never would)
    return save_family(tmp_path / "gpt_oss", "GptOssConfig", "GptOssForCausalLM", **GPT_OSS)


def test_logits_and_gradients_match_transformers(gpt_oss):
    folder, ref = gpt_oss
    model = load_hf(folder)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, None]
    assert model.model.layers[0].self_attn.sinks is not None and moe_blocks(model)
    # 48 tokens: six sliding windows long, past YaRN's original 32 positions
    check_logits_and_gradients(folder, ref, t=48, grads_as_checkpoint=gpt_oss_layout.to_checkpoint)
    check_padded_batch(load_hf(folder).eval(), ref, lengths=(40, 23))


def test_sinks_and_clamps_matter(gpt_oss):
    """Changing a sink, or the clamp limit, changes the logits: the parity above can see them."""
    folder, _ = gpt_oss
    model = load_hf(folder).eval()
    ids = torch.randint(0, 128, (1, 24))
    with torch.no_grad():
        before = model(ids)
        model.model.layers[1].self_attn.sinks.add_(1.0)
        assert (model(ids) - before).abs().max() > 1e-4
        model.model.layers[1].self_attn.sinks.sub_(1.0)
        model.model.layers[0].mlp.experts.swiglu_limit = 7.0
        assert (model(ids) - before).abs().max() > 1e-4


def test_grouped_experts_equal_the_loop(gpt_oss):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this PyTorch has no torch._grouped_mm")
    folder, _ = gpt_oss
    ids = torch.randint(0, 128, (2, 16))
    results = []
    for impl in ("loop", "grouped"):
        model = load_hf(folder)
        set_experts_implementation(model, impl)
        out = model(ids)
        out.float().logsumexp(-1).mean().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=0)
    for name in results[0][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_packed_padding_free_and_cached_generation(gpt_oss):
    folder, _ = gpt_oss
    # documents of 7, 30 and 19 tokens against a window of 8
    check_packed_equals_documents(load_hf(folder).eval(), lengths=(7, 30, 19))
    model = load_hf(folder).eval()
    ids = torch.randint(0, 128, (1, 20))
    cache = KVCache(model.config.num_layers)
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :12], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_saved_in_the_checkpoint_layout(gpt_oss, tmp_path):
    folder, ref = gpt_oss
    check_save_round_trip(folder, ref, tmp_path / "saved")


def mxfp4_folder(folder, tmp_path):
    """The folder with its expert weights as MXFP4 blocks and scales (random codes), as the released checkpoints
    store them; returns (folder, the dense [E, in, out] weights transformers' own dequantization gives)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    dense = {}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, n_in, n_out = state.pop(name).shape
        blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), generator=generator, dtype=torch.uint8)
        scales = torch.randint(118, 124, (e, n_out, n_in // 32), generator=generator, dtype=torch.uint8)
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    out = tmp_path / "mxfp4"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router"]}
    (out / "config.json").write_text(json.dumps(config))
    return out, dense


def test_mxfp4_experts_are_dequantized_as_transformers_does(gpt_oss, tmp_path):
    folder, ref = gpt_oss
    quantized, dense = mxfp4_folder(folder, tmp_path)
    model = load_hf(quantized).eval()
    ours = gpt_oss_layout.to_checkpoint({n: p.detach() for n, p in model.named_parameters()})
    for name, weight in dense.items():
        assert weight.abs().max() > 0
        torch.testing.assert_close(ours[name], weight, atol=0, rtol=0, msg=name)
    with torch.no_grad():  # transformers' model with those weights: the same logits
        for name, weight in dense.items():
            ref.get_parameter(name).copy_(weight)
        ids = torch.randint(0, 128, (2, 20))
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)
    import transformers

    saved = save_hf(model, tmp_path / "saved")  # written dense, without the quantization_config
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    back = honour_swiglu_config(
        transformers.AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval())
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)


def test_mxfp4_blocks_without_scales_are_named(gpt_oss, tmp_path):
    from entrenar.errors import ModelError

    folder, _ = gpt_oss
    quantized, _ = mxfp4_folder(folder, tmp_path)
    state = load_file(str(quantized / "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, str(quantized / "model.safetensors"))
    with pytest.raises(ModelError, match=r"model\.layers\.1\.mlp\.experts\.down_proj"):
        load_hf(quantized)


def test_lora_on_attention_matches_peft_and_the_router_is_refused(gpt_oss, tmp_path, capsys):
    from entrenar.adapters.lora import LoraConfig, apply_lora

    folder, ref = gpt_oss
    check_lora_step_matches_peft(folder, ref, ["q_proj", "k_proj", "v_proj", "o_proj"])
    with pytest.raises(AdapterError, match=r"gpt-oss's router .*model\.layers\.0\.mlp\.gate"):
        apply_lora(load_hf(folder), LoraConfig(r=2, alpha=4, target_modules=["q_proj"],
                                               target_parameters=["mlp.experts.gate_up_proj", "mlp.gate.weight"]))
    check_inspect(capsys, folder, ref)


EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_expert_adapters_load_both_ways_with_peft_and_train_alike(gpt_oss, tmp_path):
    """Per-expert LoRA in PEFT's target_parameters format: PEFT's adapter on gpt-oss's (interleaved) experts
    loads in entrenar with PEFT's logits, entrenar's loads in PEFT, and one step's adapter gradients agree."""
    import peft

    from entrenar.adapters.lora import LoraConfig, apply_lora, load_adapter, lora_layers, save_adapter

    folder, ref = gpt_oss
    theirs = peft.get_peft_model(ref, peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj"],
                                                      target_parameters=EXPERT_TARGETS))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.2)
    theirs.save_pretrained(tmp_path / "peft")
    ids = torch.randint(0, 128, (2, 16))
    ours = load_hf(folder)
    load_adapter(ours, tmp_path / "peft")
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=0)

    # one step: the loss and every adapter's gradient (entrenar's written out in PEFT's layout)
    from family_checks import shifted_ce

    loss = shifted_ce(ours(ids), ids)
    loss.backward()
    out = theirs(ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(loss, out.loss, atol=1e-5, rtol=0)
    grads = {}
    for name, layer in lora_layers(ours):
        grads[f"{name}.lora_A"] = layer.lora_A.weight.grad
        grads[f"{name}.lora_B"] = getattr(layer, "checkpoint_rows", lambda b: b)(layer.lora_B.weight.grad)
    peft_grads = {n.removeprefix("base_model.model.").replace(".default.weight", ""): p.grad
                  for n, p in theirs.named_parameters() if "lora_" in n}
    assert set(grads) == set(peft_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, peft_grads[name], atol=1e-6, rtol=1e-4, msg=name)

    # entrenar's own adapter, saved, in PEFT
    mine = load_hf(folder)
    cfg = LoraConfig(r=2, alpha=6, target_modules=["q_proj"], target_parameters=EXPERT_TARGETS, use_rslora=False)
    apply_lora(mine, cfg)
    torch.manual_seed(4)
    with torch.no_grad():
        for _, layer in lora_layers(mine):
            layer.lora_B.weight.normal_(std=0.2)
    save_adapter(mine, tmp_path / "ours", cfg)
    back = peft.PeftModel.from_pretrained(make_reference(folder), tmp_path / "ours")
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, mine(ids), atol=1e-5, rtol=0)


def make_reference(folder):
    import transformers

    return honour_swiglu_config(
        transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval())


def dequantized_reference(folder, model):
    """transformers' model on the weights an NF4 base computes with: every NF4 layer's and NF4 expert stack's
    codes dequantized, the rest (biases, norms, sinks, router, embeddings) as the model holds them."""
    from entrenar.quant.nf4.experts import NF4Experts
    from entrenar.quant.nf4.format import NF4Linear

    state = {n: p.detach() for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, NF4Linear) and ".experts." not in name:
            state[f"{name}.weight"] = module.weight
        elif isinstance(module, NF4Experts):
            state[f"{name}.gate_up_proj"], state[f"{name}.down_proj"] = module.gate_up_proj, module.down_proj
    ref = make_reference(folder)
    ref.load_state_dict(gpt_oss_layout.to_checkpoint({n: t.float() for n, t in state.items()}), strict=True)
    return ref


def test_qlora_base_quantizes_the_experts_to_nf4(gpt_oss):
    """Under an NF4 base the experts are NF4 (biases kept in the load dtype, frozen), each projection the NF4 of
    the checkpoint's de-interleaved tensor, and the model computes exactly what transformers computes on the
    dequantized codes: sinks, clamps, biases and the router are untouched."""
    from entrenar.models.moe import Experts, Router
    from entrenar.quant.nf4.experts import NF4Experts, quantize_experts_nf4
    from entrenar.quant.nf4.format import NF4Linear, dequantize_nf4, quantize_nf4
    from entrenar.quant.nf4.sinks import nf4_sinks

    folder, _ = gpt_oss
    full, nf4 = load_hf(folder).eval(), load_hf(folder, sinks=nf4_sinks).eval()
    assert isinstance(nf4.model.layers[0].self_attn.q_proj, NF4Linear)
    for _, block in moe_blocks(nf4):
        experts = block.experts
        assert type(experts) is NF4Experts and experts.interleaved_gate_up and experts.activation == "clamped_swiglu"
        assert isinstance(experts.expert(3).down_proj, NF4Linear) and type(block.gate) is Router
        assert isinstance(experts.gate_up_proj_bias, torch.nn.Parameter) and not experts.gate_up_proj_bias.requires_grad
    ours, theirs = moe_blocks(nf4)[1][1].experts, moe_blocks(full)[1][1].experts
    torch.testing.assert_close(ours.gate_up_proj_bias, theirs.gate_up_proj_bias, atol=0, rtol=0)
    i = theirs.intermediate_size
    for e in range(theirs.num_experts):
        for name, rows in (("gate_proj", slice(0, i)), ("up_proj", slice(i, 2 * i))):
            expected = dequantize_nf4(quantize_nf4(theirs.gate_up_proj[e, rows].detach()))
            assert torch.equal(getattr(ours.expert(e), name).weight, expected), (e, name)
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        a, b = full(ids), nf4(ids)
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
        torch.testing.assert_close(b, dequantized_reference(folder, nf4)(ids).logits, atol=1e-5, rtol=0)
        # quantizing the loaded model's experts gives what streaming gave
        quantize_experts_nf4(full)
        assert not any(type(m) is Experts for m in full.modules())
        x = torch.randn(1, 6, full.config.hidden_size)
        torch.testing.assert_close(moe_blocks(full)[1][1](x), moe_blocks(nf4)[1][1](x), atol=0, rtol=0)


def test_mxfp4_experts_go_to_nf4_one_expert_at_a_time(gpt_oss, tmp_path, monkeypatch):
    """An MXFP4 folder under an NF4 base: each expert's projections are the NF4 of transformers' dequantized
    weights, and no more than one expert is dequantized at once."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: F401 (mxfp4_folder's)

    from entrenar.quant.nf4.format import dequantize_nf4, quantize_nf4
    from entrenar.quant.nf4.sinks import nf4_sinks

    folder, _ = gpt_oss
    quantized, dense = mxfp4_folder(folder, tmp_path)
    dequantized = []
    original = gpt_oss_layout.dequantize_mxfp4

    def spy(blocks, scales, dtype=torch.float32):
        dequantized.append(blocks.shape[0])
        return original(blocks, scales, dtype)

    monkeypatch.setattr(gpt_oss_layout, "dequantize_mxfp4", spy)
    model = load_hf(quantized, dtype=torch.bfloat16, sinks=nf4_sinks)
    assert dequantized and set(dequantized) == {1}
    experts = moe_blocks(model)[0][1].experts
    gate_up, down = dense["model.layers.0.mlp.experts.gate_up_proj"], dense["model.layers.0.mlp.experts.down_proj"]
    for e in range(experts.num_experts):
        for name, weight in (("gate_proj", gate_up[e].T[0::2]), ("up_proj", gate_up[e].T[1::2]),
                             ("down_proj", down[e].T)):
            expected = dequantize_nf4(quantize_nf4(weight.to(torch.bfloat16).contiguous()))
            assert torch.equal(getattr(experts.expert(e), name).weight, expected), (e, name)


def test_qlora_adapters_on_nf4_experts_train_and_load_in_peft(gpt_oss, tmp_path):
    """LoRA on attention and on the NF4 experts: one step gives every adapter a gradient and nothing else one;
    the adapter saved from the NF4 base loads back unchanged, and in PEFT over transformers' model on the
    dequantized codes it gives the same logits (PEFT's layout, gate/up rows interleaved)."""
    import peft

    from entrenar.adapters.lora import LoraConfig, apply_lora, load_adapter, lora_layers, save_adapter
    from entrenar.quant.nf4.sinks import nf4_sinks

    folder, _ = gpt_oss
    model = load_hf(folder, sinks=nf4_sinks)
    cfg = LoraConfig(r=2, alpha=4, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_TARGETS,
                     use_rslora=False)
    apply_lora(model, cfg)
    from entrenar.models.moe import core_experts
    from entrenar.quant.nf4.experts import NF4Experts

    assert all(type(core_experts(block.experts)) is NF4Experts for _, block in moe_blocks(model))
    torch.manual_seed(4)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.weight.normal_(std=0.2)
    ids = torch.randint(0, 128, (2, 16))
    from family_checks import shifted_ce

    shifted_ce(model(ids), ids).backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any(".experts." in n for n in trainable)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    model.eval()
    save_adapter(model, tmp_path / "adapter", cfg)
    again = load_hf(folder, sinks=nf4_sinks).eval()
    load_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        mine = model(ids)
        torch.testing.assert_close(again(ids), mine, atol=0, rtol=0)
        back = peft.PeftModel.from_pretrained(dequantized_reference(folder, load_hf(folder, sinks=nf4_sinks)),
                                              tmp_path / "adapter").eval()
        torch.testing.assert_close(back(ids).logits, mine, atol=1e-5, rtol=0)


def test_nf4_experts_follow_moe_experts(gpt_oss):
    """``moe.experts`` (set through the LoRA wrappers) decides how NF4 experts run: ``auto`` is the loop off CUDA
    (grouped on CUDA, as for full-precision experts), ``grouped`` and ``loop`` are honoured."""
    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.quant.nf4.sinks import nf4_sinks

    folder, _ = gpt_oss
    model = load_hf(folder, sinks=nf4_sinks)
    apply_lora(model, LoraConfig(r=8, alpha=16, target_modules=["q_proj"], target_parameters=EXPERT_TARGETS))
    probe = torch.empty(0, model.config.hidden_size, dtype=torch.bfloat16)
    for setting, grouped in (("auto", False), ("grouped", True), ("loop", False)):
        set_experts_implementation(model, setting)
        for _, block in moe_blocks(model):
            assert block.experts.implementation == setting and block.experts.use_grouped(probe) is grouped


def test_qlora_grouped_nf4_experts_give_the_loop_s_loss_and_gradients(gpt_oss):
    """QLoRA on gpt-oss (LoRA on attention and on every NF4 expert, r=8 so the adapters run grouped too), every
    layer checkpointed: the grouped NF4 experts give the per-expert loop's logits, loss and adapter gradients."""
    from family_checks import shifted_ce

    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.quant.nf4.sinks import nf4_sinks

    folder, _ = gpt_oss
    ids = torch.randint(0, 128, (2, 16))
    results = []
    for impl in ("loop", "grouped"):
        model = load_hf(folder, sinks=nf4_sinks)
        torch.manual_seed(3)  # the same adapters in both
        apply_lora(model, LoraConfig(r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                     target_parameters=EXPERT_TARGETS))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1)
        set_experts_implementation(model, impl)
        model.set_activation_checkpointing(True)
        model.train()
        logits = model(ids)
        loss = shifted_ce(logits, ids)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert all(g is not None for g in grads.values()) and any(".experts." in n for n in grads)
        results.append((logits.detach(), loss.detach(), grads))
    (logits_loop, loss_loop, grads_loop), (logits_grouped, loss_grouped, grads_grouped) = results
    torch.testing.assert_close(logits_grouped, logits_loop, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss_grouped, loss_loop, atol=1e-6, rtol=1e-6)
    assert grads_loop.keys() == grads_grouped.keys()
    for name, grad in grads_loop.items():  # fp32 rounding apart: under 1e-6 of each gradient's norm here
        assert (grads_grouped[name] - grad).norm() <= 1e-5 * grad.norm(), name


def test_the_plan_says_what_the_kernels_leave_to_pytorch(gpt_oss, workspace):
    """``--dry-run`` prints the plan's reasons: for gpt-oss, that sinks and the clamped SwiGLU run in PyTorch."""
    from tests.train.test_loop import recipe_for

    from entrenar.distributed.world import World
    from entrenar.models.hf import read_config
    from entrenar.train.plan import plan_run

    folder, _ = gpt_oss
    recipe = recipe_for(workspace)
    kwargs = {"triton": True, "device_memory": 80 * 2**30, "available": (64 * 2**30, "the tests' machine")}
    reasons = dict(plan_run(recipe, torch.device("cpu"), World(), read_config(folder), **kwargs).reasons)
    note = reasons["training.kernels"]
    assert "sinks" in note and "clamped SwiGLU" in note
    llama = plan_run(recipe, torch.device("cpu"), World(), read_config(workspace / "model"), **kwargs)
    assert "sinks" not in dict(llama.reasons)["training.kernels"]


def _nibbles_as_ggml(blocks: torch.Tensor) -> torch.Tensor:
    """convert_hf_to_gguf.py's GptOssModel.transform_nibble_layout: transformers' MXFP4 bytes (value 2j in the low
    nibble of byte j, 2j + 1 in the high) in ggml's block order (value j low, j + 16 high)."""
    lo, hi = blocks & 0x0F, blocks >> 4
    values = torch.stack([lo, hi], dim=-1).flatten(-2)  # the 32 codes in order
    return values[..., :16] | (values[..., 16:] << 4)


def write_gpt_oss_gguf(path, ref, vocab: dict, mxfp4: dict | None = None):
    """A gpt-oss model as llama.cpp's converter writes it: experts split into gate/up (de-interleaved), down
    transposed, biases beside them, the router as ffn_gate_inp, sinks as attn_sinks; with ``mxfp4`` (name ->
    (blocks, scales) of transformers' layout) the expert weights repacked as GGML MXFP4 blocks."""
    import gguf
    import numpy as np

    c = ref.config
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_sliding_window(c.sliding_window)
    rope = c.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, c.num_hidden_layers)

    def add(name, t):
        w.add_tensor(name, t.detach().float().numpy())

    def add_mxfp4(name, blocks, scales):
        packed = torch.cat([scales.unsqueeze(-1), _nibbles_as_ggml(blocks)], dim=-1)
        w.add_tensor(name, packed.flatten(-2).numpy().astype(np.uint8), raw_dtype=gguf.GGMLQuantizationType.MXFP4)

    for hf_name, t in ref.state_dict().items():
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        blk = f"blk.{layer}."
        if hf_name.endswith("self_attn.sinks"):
            add(blk + "attn_sinks.weight", t)
        elif hf_name.endswith("mlp.router.weight") or hf_name.endswith("mlp.router.bias"):
            add(blk + "ffn_gate_inp." + hf_name.rsplit(".", 1)[1], t)
        elif hf_name.endswith("experts.gate_up_proj_bias"):
            add(blk + "ffn_gate_exps.bias", t[..., ::2])
            add(blk + "ffn_up_exps.bias", t[..., 1::2])
        elif hf_name.endswith("experts.down_proj_bias"):
            add(blk + "ffn_down_exps.bias", t)
        elif hf_name.endswith("experts.gate_up_proj"):
            if mxfp4:
                blocks, scales = mxfp4[hf_name]
                add_mxfp4(blk + "ffn_gate_exps.weight", blocks[:, ::2], scales[:, ::2])
                add_mxfp4(blk + "ffn_up_exps.weight", blocks[:, 1::2], scales[:, 1::2])
            else:
                t = t.transpose(-1, -2)
                add(blk + "ffn_gate_exps.weight", t[:, ::2])
                add(blk + "ffn_up_exps.weight", t[:, 1::2])
        elif hf_name.endswith("experts.down_proj"):
            if mxfp4:
                add_mxfp4(blk + "ffn_down_exps.weight", *mxfp4[hf_name])
            else:
                add(blk + "ffn_down_exps.weight", t.transpose(-1, -2))
        else:
            add(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("experts", ["f32", "mxfp4"])
def test_gguf_as_llama_cpp_writes_it(tmp_path, experts):
    """A gpt-oss GGUF (float or GGML MXFP4 experts, repacked from transformers' blocks as the converter does)
    loads with the logits of transformers' model holding transformers' own dequantization of those blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    import entrenar
    from gguf_fixtures import byte_level_vocab, train_byte_level_tokenizer

    tokenizer = train_byte_level_tokenizer("smollm")
    vocab = tokenizer.get_vocab_size() + 15
    # swiglu_limit 7 (transformers' default): llama.cpp fixes it there, and a GGUF file cannot say another
    config = {**GPT_OSS, "vocab_size": vocab, "swiglu_limit": 7.0}
    _, ref = save_family(tmp_path / "m", "GptOssConfig", "GptOssForCausalLM", **config)
    mxfp4 = None
    if experts == "mxfp4":
        generator = torch.Generator().manual_seed(6)
        mxfp4 = {}
        for name, p in ref.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                e, n_in, n_out = p.shape
                blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), generator=generator, dtype=torch.uint8)
                scales = torch.randint(118, 124, (e, n_out, n_in // 32), generator=generator, dtype=torch.uint8)
                mxfp4[name] = (blocks, scales)
                with torch.no_grad():
                    p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    path = write_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", ref, byte_level_vocab(tokenizer, vocab), mxfp4)
    model, _ = entrenar.load(path, device="cpu")
    assert model.config.model_type == "gpt_oss" and model.config.layer_types == ("sliding_attention", "full_attention")
    ids = torch.randint(0, vocab, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_estimate_counts_the_sink_attention_and_the_nf4_experts(dtype):
    """The activation estimate within 10% of what autograd saves (the sinks' products keep each query's
    probabilities, T x T per head), and QLoRA's NF4 count equal to the linear layers NF4 replaces (the
    experts' projections among them)."""
    from entrenar.models.config import ModelConfig
    from entrenar.models.transformer import Transformer
    from entrenar.quant.nf4.format import NF4Linear
    from entrenar.quant.nf4.sinks import nf4_sinks
    from entrenar.train.memory import estimate_training_memory, quantizable_params
    from test_memory import measured_saved_bytes

    config = ModelConfig.from_hf({"model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 128,
                                  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 4,
                                  "num_experts_per_tok": 2, "sliding_window": 32, "attention_bias": True})
    model = Transformer(config).to(dtype)
    model.reset_parameters()
    ids = torch.randint(0, 256, (2, 256))
    measured = measured_saved_bytes(model, ids)
    estimate = estimate_training_memory(config, "full", 2, 256, dtype_bytes=dtype.itemsize, cpu=True).activations
    assert abs(estimate - measured) / measured < 0.10, (estimate, measured)
    # On CUDA in 16 bits the sinks rescale FlashAttention's output: the layer keeps what SDPA's would.
    gpu, plain = (estimate_training_memory(c, "full", 2, 256, dtype_bytes=2).activations
                  for c in (config, dataclasses.replace(config, attention_sinks=False)))
    assert gpu == plain < estimate_training_memory(config, "full", 2, 256, dtype_bytes=2, cpu=True).activations
    with torch.device("meta"):
        meta = Transformer(config)
    nf4_sinks(meta, dtype, "meta")
    assert all(type(block.experts).__name__ == "NF4Experts" for _, block in moe_blocks(meta))
    replaced = sum(m.in_features * m.out_features for m in meta.modules() if isinstance(m, NF4Linear))
    assert quantizable_params(config) == replaced


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_kernels_give_the_plain_model_s_logits_and_gradients(gpt_oss, device):
    """apply_kernels (fused RMSNorm, RoPE, LoRA layers, MoE routing ops) on gpt-oss: sinks, the clamped SwiGLU and
    the expert biases stay as the plain model computes them, on the grouped expert path too."""
    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.kernels import apply_kernels

    folder, _ = gpt_oss
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    models = []
    for fused in (False, True):
        model = load_hf(folder, dtype=dtype, device=device)
        torch.manual_seed(7)  # the same adapters in both
        apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        if hasattr(torch, "_grouped_mm"):
            set_experts_implementation(model, "grouped")
        if fused:
            assert apply_kernels(model)
        models.append(model)
    ids = torch.randint(0, 128, (2, 24), device=device)
    outs = []
    for model in models:
        out = model(ids)
        out.float().logsumexp(-1).mean().backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        outs.append((out.detach().float(), grads))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=tol, rtol=tol)
    assert outs[0][1].keys() == outs[1][1].keys()
    for name in outs[0][1]:
        torch.testing.assert_close(outs[1][1][name], outs[0][1][name], atol=tol, rtol=tol, msg=name)
