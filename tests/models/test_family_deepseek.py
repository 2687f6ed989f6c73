"""DeepSeek-V3 (Kimi-K2 and Moonlight share it) against transformers: multi-head latent attention (with and
without the low-rank query), sigmoid routing with the correction bias over grouped top-k, routed scaling, shared
experts and dense first layers; saved back in the checkpoint's layout; the padding-free and cached paths."""

from __future__ import annotations

import pytest
import torch
from family_checks import (
    check_logits_and_gradients,
    check_padded_batch,
    check_save_round_trip,
    perturb_norms_biases_sinks,
)

from entrenar.models.hf import load_hf

DEEPSEEK = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
                q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
                num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5, eos_token_id=2,
                pad_token_id=0)


def make_deepseek(seed: int = 0, **overrides):
    """A tiny transformers DeepseekV3ForCausalLM, norms and the correction bias perturbed so they matter."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**DEEPSEEK, **overrides})).eval()
    perturb_norms_biases_sinks(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.2)
    return model


@pytest.fixture
def deepseek_folder(tmp_path):
    def build(**overrides):
        model = make_deepseek(**overrides)
        folder = tmp_path / f"deepseek{len(list(tmp_path.iterdir()))}"
        model.save_pretrained(folder)
        return folder, model

    return build


VARIANTS = {
    "q_lora": {},
    "plain_q": dict(q_lora_rank=None),
    "no_interleave_bias": dict(rope_interleave=False, attention_bias=True, norm_topk_prob=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_of_padded_batches_match_transformers(deepseek_folder, variant):
    folder, ref = deepseek_folder(**VARIANTS[variant])
    check_padded_batch(load_hf(folder).eval(), ref, lengths=(20, 13))


def test_loss_gradients_match_transformers(deepseek_folder):
    folder, ref = deepseek_folder()
    check_logits_and_gradients(folder, ref, t=16)  # transformers' module names, every parameter's gradient


def test_save_round_trip_in_the_checkpoint_layout(deepseek_folder, tmp_path):
    import json

    folder, ref = deepseek_folder(q_lora_rank=None)
    out = tmp_path / "saved"
    check_save_round_trip(folder, ref, out)
    saved, original = json.loads((out / "config.json").read_text()), json.loads((folder / "config.json").read_text())
    for key in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group",
                "topk_group", "routed_scaling_factor", "n_shared_experts", "n_routed_experts", "first_k_dense_replace",
                "moe_intermediate_size", "rope_interleave", "norm_topk_prob"):
        assert saved[key] == original[key], key


def test_padding_free_rows_equal_each_document_alone(deepseek_folder):
    """Documents end to end in one row with cu_seqlens, in fp32 and in bf16 on the CPU (its explicit products,
    where values are narrower than queries), and packed under a document mask, against each document alone."""
    folder, _ = deepseek_folder()
    lengths = [7, 12, 5]
    torch.manual_seed(3)
    docs = [torch.randint(3, 128, (1, n)) for n in lengths]
    row = torch.cat(docs, dim=1)
    cu = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        model = load_hf(folder, dtype=dtype).eval()
        with torch.no_grad():
            packed = model(row, position_ids=positions, cu_seqlens=cu)
            alone = torch.cat([model(d) for d in docs], dim=1)
            masked = model(row, position_ids=positions, document_ids=document_ids)  # packed rows, a document mask
        torch.testing.assert_close(packed.float(), alone.float(), atol=atol, rtol=0)
        torch.testing.assert_close(masked.float(), alone.float(), atol=atol, rtol=0)


def test_cached_generation_equals_the_full_forward(deepseek_folder):
    from entrenar.models.transformer import KVCache

    folder, ref = deepseek_folder()
    model = load_hf(folder).eval()
    ids = torch.randint(3, 128, (2, 10))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.config.num_layers)
        steps = [model(ids[:, :6], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(6, 10)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
        assert cache.keys[0].shape[-1] == 16  # the latent is cached, not the expanded keys
        generated = ref.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
    from entrenar.generation.sampling import generate

    assert generate(model, ids[0, :5].tolist(), max_new_tokens=4) == generated[0, 5:].tolist()


def test_varlen_kernel_gets_values_padded_to_the_query_head_size(monkeypatch):
    """FlashAttention's variable-length kernel takes one head size: MLA's narrower values are zero-padded for it
    and the output cut back (a stand-in kernel here, which refuses unequal sizes as FlashAttention does)."""
    import torch.nn.functional as F

    from entrenar.models import padding_free

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FlashAttention needs one head size"
        bounds = cu_q.tolist()
        return torch.cat([F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (q, k, v)),
                                                         is_causal=True).transpose(0, 1)
                          for s, e in zip(bounds[:-1], bounds[1:])])

    monkeypatch.setattr(padding_free, "_varlen_attn", fake_varlen)
    monkeypatch.setattr(padding_free, "_varlen_fits", lambda *args: True)
    torch.manual_seed(4)
    q, k = torch.randn(1, 4, 11, 24), torch.randn(1, 4, 11, 24)
    v = torch.randn(1, 4, 11, 12)
    documents = padding_free.Documents(torch.tensor([0, 5, 11], dtype=torch.int32), 6)
    out = padding_free.documents_attention(q, k, v, documents)
    monkeypatch.undo()
    torch.testing.assert_close(out, padding_free.documents_attention(q, k, v, documents), atol=1e-6, rtol=0)
    assert out.shape == (1, 11, 4, 12)


MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def test_lora_on_the_latent_projections_against_peft(deepseek_folder, tmp_path):
    """PEFT's adapter on the MLA projections (by their real names) loads in entrenar; one training step's adapter
    gradients equal PEFT's; entrenar's saved adapter loads in peft with equal logits."""
    import peft
    from family_checks import shifted_ce

    from entrenar.adapters.lora import load_adapter, lora_layers, save_adapter

    folder, ref = deepseek_folder()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=MLA_TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM")
    theirs = peft.get_peft_model(ref, config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    theirs.save_pretrained(tmp_path / "peft")
    ours = load_hf(folder)
    cfg = load_adapter(ours, tmp_path / "peft")
    adapted = {name.rsplit(".", 1)[-1] for name, _ in lora_layers(ours)}
    assert adapted == set(MLA_TARGETS)
    ids = torch.randint(3, 128, (2, 14))
    theirs.train()
    ours.train()
    ref_loss = theirs(input_ids=ids, labels=ids).loss
    loss = shifted_ce(ours(ids), ids)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    ref_loss.backward()
    loss.backward()
    ref_grads = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad
                 for n, p in theirs.named_parameters() if "lora_" in n}
    our_grads = {n: p.grad for n, p in ours.named_parameters() if "lora_" in n}
    assert set(our_grads) == set(ref_grads) and len(our_grads) == 2 * len(MLA_TARGETS) * 3
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    save_adapter(ours, tmp_path / "ours", cfg)
    back = peft.PeftModel.from_pretrained(make_deepseek(), tmp_path / "ours").eval()
    ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, ours(ids), atol=1e-5, rtol=0)


def test_qlora_nf4_base_loads_and_trains_through_the_latent_projections(deepseek_folder):
    """The NF4 base streams in (every MLA projection and expert stack quantized, as quantizing after load does);
    adapters on the MLA projections get the gradients they get on the dequantized base."""
    import copy

    from torch import nn

    from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters
    from entrenar.models.surgery import replace_module
    from entrenar.quant.nf4.format import NF4Linear, quantize_model_nf4
    from entrenar.quant.nf4.sinks import nf4_sinks

    folder, _ = deepseek_folder()
    qlora = load_hf(folder, sinks=nf4_sinks)
    reference = load_hf(folder)
    quantize_model_nf4(reference)
    attention = qlora.model.layers[1].self_attn
    assert all(isinstance(getattr(attention, n), NF4Linear) for n in MLA_TARGETS)
    assert type(qlora.model.layers[1].mlp.experts).__name__ == "NF4Experts"
    for layer, ref_layer in zip(qlora.model.layers, reference.model.layers):
        ours, theirs = layer.self_attn.state_dict(), ref_layer.self_attn.state_dict()
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), name
    dequantized = copy.deepcopy(qlora)
    for name, module in list(dequantized.named_modules()):
        if isinstance(module, NF4Linear):
            replace_module(dequantized, name, module.to_linear())
    ids = torch.randint(3, 128, (2, 12))
    grads = []
    for model in (qlora, dequantized):
        torch.manual_seed(3)
        apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=MLA_TARGETS))
        for p in lora_parameters(model):
            if p.abs().sum() == 0:
                nn.init.normal_(p, std=0.05)
        model(ids).float().logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 5 * 3
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4)


def test_estimates_count_mla_parameters_and_saved_activations(deepseek_folder):
    """``inspect``'s numbers: the parameter count equals transformers' model's; the LoRA and NF4 counts equal the
    modules'; the activations MLA saves for backward (measured through autograd's saved-tensor hooks) equal the
    estimate, with and without the low-rank query. The CPU's SDPA keeps its [T, T] probabilities where
    memory-efficient attention keeps a log-sum-exp: that one term is swapped."""
    from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters
    from entrenar.train.memory import lora_params, mla_activation_bytes, quantizable_params

    for q_lora_rank in (24, None):
        folder, ref = deepseek_folder(q_lora_rank=q_lora_rank)
        model = load_hf(folder)
        config = model.config
        assert config.num_parameters == sum(p.numel() for p in ref.parameters())
        adapted = load_hf(folder)
        apply_lora(adapted, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
        assert lora_params(config, 4, "all-linear") == sum(p.numel() for p in lora_parameters(adapted))
        assert quantizable_params(config) == sum(  # every matrix but the embeddings, head and routers
            p.numel() for n, p in ref.named_parameters()
            if p.dim() > 1 and not n.endswith(("embed_tokens.weight", "lm_head.weight", "gate.weight")))
        t = 32
        x = torch.randn(1, t, config.hidden_size, requires_grad=True)
        cos, sin = model.rope(torch.arange(t)[None], x.dtype)
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda s, kept=saved: kept.append(s) or s, lambda s: s):
            model.model.layers[0].self_attn(x, cos, sin, None)
        skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        skip |= {s.untyped_storage().data_ptr() for s in (x, cos, sin)}
        storages = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in saved
                    if s.untyped_storage().data_ptr() not in skip and s.shape[-2:] != (t, t)}
        assert sum(storages.values()) / t == mla_activation_bytes(config, 4) - config.num_heads * 4



def test_kernels_leave_mla_blocks_plain_and_the_plan_says_so(deepseek_folder, workspace):
    """The fused kernels keep the model's numbers (MLA blocks are not given the norm-inside-LoRA fused block,
    whose forward calls q/k/v projections MLA has not), and the plan's reason for training.kernels names what
    they leave to PyTorch."""
    from tests.train.test_loop import recipe_for

    from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters
    from entrenar.distributed.world import World
    from entrenar.kernels import apply_kernels
    from entrenar.models.hf import read_config
    from entrenar.models.transformer import Block
    from entrenar.train.plan import plan_run

    folder, _ = deepseek_folder()
    ids = torch.randint(3, 128, (2, 12))
    results = []
    for kernels in (False, True):
        model = load_hf(folder)
        torch.manual_seed(0)
        apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
        for p in lora_parameters(model):
            torch.nn.init.normal_(p, std=0.05)
        if kernels:
            apply_kernels(model)
            assert all(type(layer) is Block for layer in model.model.layers)
        logits = model(ids)
        logits.float().logsumexp(-1).mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-5, rtol=1e-4)

    plan = plan_run(recipe_for(workspace), torch.device("cpu"), World(), read_config(folder), triton=True,
                    device_memory=80 * 2**30, available=(64 * 2**30, "the tests' machine"))
    reason = dict(plan.reasons)["training.kernels"]
    assert plan.kernels and "multi-head latent attention runs its PyTorch path" in reason


def write_deepseek_gguf(path, model, vocab, split_kv_b: bool = True, gating: int | None = 2, skip=()):
    """A transformers DeepSeek-V3 model as llama.cpp's convert_hf_to_gguf.py (DeepseekV2Model) writes it: MLA as
    MQA metadata, kv_b_proj split into attn_k_b (transposed per head) and attn_v_b (or kept whole, as older
    converters did), experts stacked, the correction bias as exp_probs_b.bias; names from gguf's own map."""
    import gguf

    c = model.config
    arch = gguf.MODEL_ARCH.DEEPSEEK2
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    if gating is not None:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    for name, t in model.state_dict().items():
        data = t.detach().float()
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        pieces = {name: data}
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = data.chunk(2, dim=1)
            pieces = {name.replace("gate_up_proj", "gate_proj.weight"): gate,
                      name.replace("gate_up_proj", "up_proj.weight"): up}
        elif name.endswith("mlp.experts.down_proj"):
            pieces = {name + ".weight": data}
        elif name.endswith("e_score_correction_bias"):
            pieces = {name.replace("e_score_correction_bias", "e_score_correction.bias"): data}
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            kv_b = data.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
            k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
            pieces = {f"model.layers.{layer}.self_attn.k_b_proj.weight": k_b.transpose(1, 2),
                      f"model.layers.{layer}.self_attn.v_b_proj.weight": v_b}
        for hf_name, tensor in pieces.items():
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, hf_name
            if gguf_name not in skip:
                w.add_tensor(gguf_name, tensor.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["k_b-v_b", "kv_b"])
def test_gguf_as_llama_cpp_writes_it_loads_with_transformers_logits(tmp_path, split_kv_b):
    import entrenar
    from gguf_fixtures import byte_level_vocab, train_byte_level_tokenizer

    tokenizer = train_byte_level_tokenizer("smollm", vocab_size=300)
    vocab_size = tokenizer.get_vocab_size()
    ref = make_deepseek(vocab_size=vocab_size, q_lora_rank=None if split_kv_b else 24)
    path = write_deepseek_gguf(tmp_path / "ds.gguf", ref, byte_level_vocab(tokenizer, vocab_size), split_kv_b)
    model, _ = entrenar.load(str(path), device="cpu", dtype="float32")  # beside the CPU reference
    assert model.config.model_type == "deepseek_v3" and model.config.rope_interleave
    ids = torch.randint(0, vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("change, message", [
    (dict(gating=None), r"expert_gating_func is None: only DeepSeek-V3's sigmoid"),
    (dict(skip=("blk.1.attn_v_b.weight",)), r"blk\.1\.attn_v_b\.weight"),
])
def test_bad_deepseek_gguf_is_refused_naming_what(tmp_path, change, message):
    from entrenar.errors import ModelError
    from entrenar.models.gguf import read_gguf
    from gguf_fixtures import byte_level_vocab, train_byte_level_tokenizer

    tokenizer = train_byte_level_tokenizer("smollm", vocab_size=300)
    ref = make_deepseek(vocab_size=tokenizer.get_vocab_size())
    path = write_deepseek_gguf(tmp_path / "ds.gguf", ref, byte_level_vocab(tokenizer, ref.config.vocab_size), **change)
    with pytest.raises(ModelError, match=message):
        read_gguf(path)


def test_sigmoid_balance_loss_is_deepseek_v3s_complementary_loss():
    """With sigmoid routing the Switch-style loss reads each token's normalised sigmoid scores, as DeepSeek-V3's
    complementary balance loss does (eq. 17-20: f_i = E / (k T) * count_i, P_i = mean of s_i / sum_j s_j),
    which it equals times k over one sequence; softmax probabilities would give another number."""
    from entrenar.train.moe import load_balancing_loss

    torch.manual_seed(0)
    e, k, t = 8, 3, 11
    logits = torch.randn(t, e) * 2
    indices = (logits.sigmoid() + torch.randn(e) * 0.3).topk(k, dim=-1).indices  # picked with a selection bias
    scores = logits.sigmoid()
    f = e / (k * t) * torch.zeros(e).scatter_add_(0, indices.reshape(-1), torch.ones(t * k))
    p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)
    deepseek = (f * p).sum()
    ours = load_balancing_loss([(logits, indices)], e, scoring="sigmoid")
    torch.testing.assert_close(ours, k * deepseek, atol=1e-6, rtol=0)
    assert not torch.allclose(load_balancing_loss([(logits, indices)], e), ours, atol=1e-3)


def test_full_fine_tuning_nudges_the_checkpoints_own_correction_bias(tmp_path, workspace):
    """moe.bias_update_rate moves DeepSeek-V3's own e_score_correction_bias (aux-loss-free balancing); the saved
    folder keeps it where transformers reads it, and the aux loss trains the router through the sigmoid scores."""
    import json

    import transformers
    from safetensors import safe_open

    from entrenar import quickstart
    from entrenar.config import load_recipe
    from entrenar.train.loop import train

    tokenizer = quickstart.build_tokenizer()
    ref = make_deepseek(vocab_size=tokenizer.vocab_size, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    ref.save_pretrained(tmp_path / "ds")
    tokenizer.save(tmp_path / "ds")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""
model: {{path: {tmp_path / 'ds'}, device: cpu}}
data: {{train: {workspace / 'train.jsonl'}, seq_len: 32, train_on: completion}}
lora: null
optimizer: {{lr: 1.0e-3}}
training: {{max_steps: 2, batch_size: 2, log_every: 1, save_every: 2}}
moe: {{aux_loss: 0.01, bias_update_rate: 0.01}}
output: {{dir: {tmp_path / 'run'}}}
""")
    result = train(load_recipe(recipe, []), progress=False)
    records = [r for r in read_metrics_of(result.run_dir) if "loss" in r]
    assert len(records) == 2 and records[0]["moe"]["aux_loss"] > 0
    state = json.loads((result.checkpoint / "trainer.json").read_text())["moe"]
    before = ref.model.layers[1].mlp.gate.e_score_correction_bias
    moved = torch.tensor(state["bias"][0])
    assert (moved - before).abs().max() == pytest.approx(0.02, abs=1e-6)  # two steps of +-0.01
    folder = result.run_dir / "model"  # the run's final model, in the checkpoint's layout
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        saved = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    torch.testing.assert_close(saved, moved, atol=0, rtol=0)
    back = transformers.AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(back.model.layers[1].mlp.gate.e_score_correction_bias, moved, atol=0, rtol=0)


def read_metrics_of(run_dir):
    from entrenar.train.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def test_multi_token_prediction_layers_of_released_checkpoints_are_skipped(deepseek_folder):
    """DeepSeek-V3's released folders carry num_nextn_predict_layers extra layers after the last one (its MTP
    module); transformers skips them on load, and so does entrenar; a layer past those is still an error."""
    from safetensors.torch import load_file, save_file

    from entrenar.errors import ModelError

    folder, ref = deepseek_folder()
    state = load_file(str(folder / "model.safetensors"))
    state.update({k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in state.items()
                  if k.startswith("model.layers.2.")})
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(3, 128, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(folder)(ids), ref(ids).logits, atol=1e-4, rtol=0)
    state["model.layers.4.input_layernorm.weight"] = torch.ones(64)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"model\.layers\.4\.input_layernorm\.weight"):
        load_hf(folder)


def test_yarn_softmax_scale_is_transformers():
    """MLA's softmax scale with YaRN's mscale_all_dim (what queries are multiplied by before SDPA), against
    transformers' DeepseekV3Attention.scaling."""
    from types import SimpleNamespace

    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from entrenar.models.mla import softmax_scale

    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
    config = transformers.DeepseekV3Config(**{**DEEPSEEK, "rope_parameters": yarn, "max_position_embeddings": 163840})
    ours = softmax_scale(SimpleNamespace(qk_head_dim=24, rope_scaling=yarn))  # type: ignore[arg-type]
    assert ours == pytest.approx(DeepseekV3Attention(config, 0).scaling, rel=1e-12)
    assert ours != pytest.approx(24 ** -0.5)


@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.707])
def test_yarn_rope_of_released_configs_matches_transformers(deepseek_folder, mscale_all_dim):
    """The released DeepSeek-V3 / Kimi-K2 config.json gives YaRN as legacy ``rope_scaling`` (``type: yarn``,
    ``mscale`` and ``mscale_all_dim``): it loads with transformers' logits. Its cos and sin are multiplied by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1 when they are equal, as released; 0.707 makes it
    differ) and MLA's softmax scale by mscale(factor, mscale_all_dim)^2."""
    import json

    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 8, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": mscale_all_dim, "rope_theta": 10000.0}
    folder, ref = deepseek_folder(rope_parameters=yarn, max_position_embeddings=320)
    config = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        config.pop(key, None)
    config["rope_theta"] = 10000.0
    config["rope_scaling"] = {"type": "yarn", **{k: v for k, v in yarn.items() if k not in ("rope_type", "rope_theta")}}
    (folder / "config.json").write_text(json.dumps(config))
    model = load_hf(folder).eval()
    assert model.config.rope_scaling["rope_type"] == "yarn"
    ids = torch.randint(3, 128, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


def test_classification_head_equals_transformers(tmp_path):
    """DeepseekV3ForSequenceClassification (left padding: the last real token is the last column) loads as the
    classifier over the same decoder, with transformers' logits."""
    import transformers

    from entrenar.models.classifier import load_classifier_folder

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{**DEEPSEEK, "num_labels": 3, "pad_token_id": 0})
    ref = transformers.DeepseekV3ForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path)
    ours = load_classifier_folder(tmp_path, torch.float32, "cpu").eval()
    ids = torch.randint(3, 128, (3, 9))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, mask), ref(input_ids=ids, attention_mask=mask).logits, atol=1e-5,
                                   rtol=1e-5)


def test_gguf_export_is_refused_naming_the_family(deepseek_folder, tmp_path):
    """Writing DeepSeek GGUF files is not supported (entrenar's writer covers dense families): one clear error
    naming the family, and no file left behind."""
    from entrenar import quickstart
    from entrenar.errors import ModelError
    from entrenar.export.gguf_write import write_gguf

    folder, _ = deepseek_folder()
    with pytest.raises(ModelError, match="deepseek_v3 models is not supported"):
        write_gguf(load_hf(folder), quickstart.build_tokenizer(), tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
