"""Gemma 2 and Gemma 3 (text) as flags of the one decoder, against transformers' own classes.

The tiny checkpoints are written by transformers (Gemma2ForCausalLM, Gemma3ForCausalLM) with every norm and the
embeddings perturbed, soft caps small enough to bite, a query_pre_attn_scalar unlike head_dim, a sliding window
shorter than the sequences and (Gemma 3) a linear-scaled global RoPE beside the local base.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from family_checks import check_batched_generation, check_packed_equals_documents, check_padded_batch

from entrenar.models.hf import load_hf, save_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from tiny_chat_tokenizer import chat_tokenizer  # noqa: E402

GEMMA = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})),
}
FAMILIES = list(GEMMA)
VOCAB = 96
WINDOW = 5


def make_gemma(family: str, seed: int = 0, **overrides):
    """A tiny random transformers Gemma in fp32 eval mode, norms perturbed so (1 + w) and each norm matters."""
    import transformers

    config_cls, model_cls, extra = GEMMA[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{
        **dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
               initializer_range=0.2, pad_token_id=0),
        **extra, **overrides})
    # Eager attention: transformers' one path that soft-caps scores in every release (5.17's SDPA path, which
    # Gemma 2 still allowed there, drops the cap; 5.24 refuses SDPA for it).
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


@pytest.fixture(params=FAMILIES)
def gemma(request, tmp_path):
    """(family, folder written by transformers, the transformers model)."""
    ref = make_gemma(request.param)
    folder = tmp_path / request.param
    ref.save_pretrained(folder)
    return request.param, folder, ref


def test_config_reads_the_gemma_flags(gemma):
    family, folder, ref = gemma
    config = load_hf(folder).config
    assert config.model_type == family
    assert config.scale_embeddings and config.norm_unit_offset and config.sandwich_norms
    assert config.hidden_act == "gelu_pytorch_tanh" and config.query_pre_attn_scalar == 24
    assert config.layer_types == tuple(ref.config.layer_types)
    assert config.tie_word_embeddings
    assert config.final_logit_softcapping == 3.0
    if family == "gemma2":
        assert config.attn_logit_softcapping == 2.0 and config.rope_local_theta is None
    else:
        assert config.attn_logit_softcapping is None and config.qk_norm and not config.qk_norm_full
        assert config.rope_local_theta == 50.0 and config.rope_theta == 100_000.0
        assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # The parameter count inspect and the plan estimate from agrees with the model's.
    assert config.num_parameters == sum(p.numel() for p in ref.parameters())


def test_logits_loss_and_gradients_match_transformers(gemma):
    family, folder, ref = gemma
    model = load_hf(folder).eval()
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 3 * WINDOW + 2))  # longer than the sliding window
    labels = ids.clone()
    labels[:, :3] = -100
    out = ref(ids, labels=labels)
    logits = model(ids)
    torch.testing.assert_close(logits, out.logits, atol=1e-4, rtol=0)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, out.loss, atol=1e-5, rtol=0)
    out.loss.backward()
    loss.backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_each_flag_matters(gemma):
    """The soft caps, the window and the local RoPE base change the logits: the parity above can fail."""
    family, folder, ref = gemma
    model = load_hf(folder).eval()
    ids = torch.randint(1, VOCAB, (1, 3 * WINDOW))
    with torch.no_grad():
        base = model(ids)
        changes = {"final_logit_softcapping": None, "sliding_window": None,
                   "query_pre_attn_scalar": 16}
        if family == "gemma2":
            changes["attn_logit_softcapping"] = None
        else:
            changes["rope_local_theta"] = None
        for key, value in changes.items():
            other = type(model)(model.config.replace(**{key: value}))
            other.load_state_dict(model.state_dict())
            assert (other(ids) - base).abs().max() > 1e-3, key


def test_padded_batch_matches_transformers(gemma):
    """Right padding with transformers' attention mask: the real positions' logits agree."""
    family, folder, ref = gemma
    check_padded_batch(load_hf(folder).eval(), ref, lengths=(3 * WINDOW, 3 * WINDOW - 4))


def test_padding_free_and_packed_rows_equal_each_document_alone(gemma):
    """Documents read end to end (cu_seqlens) and packed rows (document_ids) give each document the logits it gets
    alone, the sliding window counted within each document."""
    family, folder, _ = gemma
    check_packed_equals_documents(load_hf(folder).eval(), lengths=(2 * WINDOW + 1, 3, WINDOW + 2))


def test_generation_cache_matches_a_full_forward(gemma):
    """KV-cache decoding past the window gives the logits of a full forward (the windowed mask with a past)."""
    family, folder, _ = gemma
    model = load_hf(folder).eval()
    from entrenar.models.transformer import KVCache

    ids = torch.randint(1, VOCAB, (1, 2 * WINDOW + 3))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.config.num_layers)
        steps = [model(ids[:, :4], cache=cache)]
        for i in range(4, ids.shape[1]):
            steps.append(model(ids[:, i : i + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_save_in_the_checkpoint_layout_loads_in_transformers(gemma, tmp_path):
    """Norm weights are saved as Gemma holds them (w of 1 + w): transformers loads our folder to equal logits."""
    import transformers

    family, folder, ref = gemma
    model = load_hf(folder)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # a change transformers must see as it is
    out = save_hf(model, tmp_path / "saved")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back).__name__ == type(ref).__name__
    assert back.config.layer_types == ref.config.layer_types
    ids = torch.randint(1, VOCAB, (2, 2 * WINDOW + 1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), back(ids).logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(back.model.norm.weight, ref.model.norm.weight + 0.5)


def test_lora_step_gradients_equal_peft_s_through_the_fused_soft_capped_loss(gemma, tmp_path):
    """PEFT's adapter on transformers' Gemma and the same adapter on ours: equal loss and LoRA gradients, ours
    through the training path's fused loss (final-logit soft-capping inside it) on a padded, masked batch."""
    import copy

    import peft

    from entrenar.adapters.lora import load_adapter, lora_layers
    from entrenar.kernels.fused_linear_ce import fused_linear_cross_entropy

    family, folder, ref = gemma
    theirs = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    theirs.save_pretrained(tmp_path / "adapter")
    model = load_hf(folder)
    load_adapter(model, tmp_path / "adapter")
    assert len(list(lora_layers(model))) == 7 * model.config.num_layers

    ids = torch.randint(1, VOCAB, (2, 2 * WINDOW + 3))
    labels = ids.clone()
    labels[:, :2] = -100
    labels[1, -3:] = -100
    expected = theirs(input_ids=ids, labels=labels).loss
    expected.backward()
    hidden = model.hidden_states(ids)
    loss_sum, n = fused_linear_cross_entropy(hidden, model.lm_head.weight, labels, chunk_size=7,
                                             softcap=model.config.final_logit_softcapping)
    loss = loss_sum / n
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    theirs_grads = {n.replace("base_model.model.", "").replace(".default", ""): p.grad
                    for n, p in theirs.named_parameters() if "lora_" in n}
    ours = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert ours.keys() == theirs_grads.keys()
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_lora_training_follows_peft_step_by_step(gemma, tmp_path):
    """Ten AdamW steps with clipping from PEFT's own initial adapter: ours (kernels applied, the fused loss with
    Gemma's final soft cap) gives PEFT's loss and gradient norm at every step, and its final adapter."""
    import copy

    import peft

    from entrenar.adapters.lora import load_adapter
    from entrenar.kernels import apply_kernels
    from entrenar.kernels.fused_linear_ce import fused_linear_cross_entropy

    family, folder, ref = gemma
    theirs = peft.get_peft_model(copy.deepcopy(ref), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    theirs.save_pretrained(tmp_path / "adapter")
    model = load_hf(folder)
    load_adapter(model, tmp_path / "adapter")
    apply_kernels(model)
    theirs_params = {n.replace("base_model.model.", "").replace(".default", ""): p
                     for n, p in theirs.named_parameters() if p.requires_grad}
    ours_params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert ours_params.keys() == theirs_params.keys()
    names = sorted(ours_params)
    optimizers = [torch.optim.AdamW([params[n] for n in names], lr=1e-2, weight_decay=0.0)
                  for params in (theirs_params, ours_params)]
    generator = torch.Generator().manual_seed(3)
    for step in range(10):
        ids = torch.randint(1, VOCAB, (2, 2 * WINDOW + 2), generator=generator)
        expected = theirs(input_ids=ids, labels=ids).loss
        loss_sum, n = fused_linear_cross_entropy(model.hidden_states(ids), model.lm_head.weight, ids,
                                                 softcap=model.config.final_logit_softcapping)
        got = loss_sum / n
        norms = []
        for loss, params, optimizer in zip((expected, got), (theirs_params, ours_params), optimizers):
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_([params[n] for n in names], 1.0))
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=f"step {step} loss")
        torch.testing.assert_close(norms[1], norms[0], atol=1e-4, rtol=1e-4, msg=f"step {step} grad norm")
    for name in names:
        torch.testing.assert_close(ours_params[name], theirs_params[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_causal_lm_task_s_fused_loss_soft_caps_as_the_plain_one(gemma):
    """Training's loss with the fused output projection (kernels on) equals the plain loss on the model's
    soft-capped logits (kernels off), padding-free row and all."""
    from entrenar.tasks.causal_lm import CausalLMTask

    family, folder, _ = gemma
    model = load_hf(folder)
    ids = torch.randint(1, VOCAB, (1, 2 * WINDOW + 4))
    labels = ids.clone()
    labels[0, 0] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(ids.shape[1])[None],
             "cu_seqlens": torch.tensor([0, 6, ids.shape[1]], dtype=torch.int32), "max_seqlen": ids.shape[1] - 6}
    losses = []
    for kernels in (True, False):
        task = CausalLMTask(recipe=None, kernels=kernels)  # type: ignore[arg-type]  # loss_sum reads no recipe
        task.prepare(model)
        assert (task._head is not None) == kernels
        losses.append(task.loss_sum(model, batch))
    torch.testing.assert_close(losses[0], losses[1], atol=1e-4, rtol=1e-6)


def write_llama_cpp_gguf(path, ref, vocab) -> None:
    """``ref`` as convert_hf_to_gguf.py lays a Gemma 2/3 out: the gguf package's tensor names for the
    architecture, every norm weight stored plus one, no output tensor for a tied head, the metadata it writes
    (no query_pre_attn_scalar, no layer pattern, no local RoPE base: llama.cpp fixes those)."""
    import gguf

    c = ref.config
    arch = gguf.MODEL_ARCH.GEMMA2 if c.model_type == "gemma2" else gguf.MODEL_ARCH.GEMMA3
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    if c.model_type == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    else:
        full = c.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    for name, t in ref.state_dict().items():
        if name == "lm_head.weight":
            continue
        data = t.detach().float() + (1 if name.endswith("norm.weight") else 0)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), data.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_entrenar_load_of_a_llama_cpp_gguf_gives_transformers_logits(family, tmp_path):
    """Layers as llama.cpp fixes them: Gemma 2 every 2nd global, Gemma 3 every 6th with local base 10000, and
    query_pre_attn_scalar = head_dim (these are not 27B shapes)."""
    import entrenar
    from gguf_fixtures import byte_level_vocab, train_byte_level_tokenizer

    tokenizer = train_byte_level_tokenizer("smollm")
    vocab_size = tokenizer.get_vocab_size() + 5
    pattern = 2 if family == "gemma2" else 6
    layers = 7 if family == "gemma3_text" else 3
    layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    overrides: dict = dict(vocab_size=vocab_size, query_pre_attn_scalar=16, num_hidden_layers=layers,
                           layer_types=layer_types)
    if family == "gemma3_text":
        overrides["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                           "rope_theta": 100_000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    ref = make_gemma(family, **overrides)
    path = tmp_path / f"{family}.gguf"
    write_llama_cpp_gguf(path, ref, byte_level_vocab(tokenizer, vocab_size))
    model, _ = entrenar.load(path, device="cpu")
    assert model.config.layer_types == tuple(layer_types)
    ids = torch.randint(1, vocab_size, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


def test_inspect_counts_parameters_as_transformers_and_peft(gemma, capsys):
    """``entrenar inspect`` estimates from the config: totals and LoRA's trainable count equal the real models'."""
    import json

    from peft import LoraConfig, get_peft_model

    from entrenar.cli.main import main

    family, folder, ref = gemma
    capsys.readouterr()
    assert main(["inspect", str(folder), "--lora-r", "4", "--lora-targets", "all-linear", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out)
    assert report["architecture"]["model_type"] == family
    assert report["architecture"]["layer_types"] == ref.config.layer_types
    assert report["architecture"]["final_logit_softcapping"] == 3.0
    assert main(["inspect", str(folder)]) == 0
    assert "soft caps: " in capsys.readouterr().out
    assert report["parameters"]["total"] == sum(p.numel() for p in ref.parameters())
    peft_model = get_peft_model(ref, LoraConfig(r=4, target_modules="all-linear"))
    assert report["parameters"]["lora_trainable"] == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def test_qlora_nf4_base_loads_and_trains(gemma):
    """Every projection in NF4 (the head stays plain), logits near the full-precision ones, and a LoRA step runs
    through the soft caps to finite gradients."""
    import entrenar
    from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters

    family, folder, ref = gemma
    model, _ = entrenar.load(folder, quantize="nf4", dtype="float32", device="cpu")
    quantized = [n for n, m in model.named_modules() if type(m).__name__.startswith("NF4")]
    assert len(quantized) == 7 * model.config.num_layers
    ids = torch.randint(1, VOCAB, (2, 2 * WINDOW + 1))
    with torch.no_grad():
        full = ref(ids).logits
        got = model(ids)
    assert torch.corrcoef(torch.stack([got.flatten(), full.flatten()]))[0, 1] > 0.9
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    model.train()
    loss = F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lora_parameters(model))


def test_classification_head_matches_transformers(gemma):
    """A fresh classification head on the Gemma backbone: transformers' *ForSequenceClassification with the same
    head gives the same logits on a right-padded batch (last real token pooled, no soft cap on the scores)."""
    import transformers

    from entrenar.models.classifier import from_backbone

    family, folder, _ = gemma
    ours = from_backbone(load_hf(folder), num_labels=3).eval()
    cls = getattr(transformers, "Gemma2ForSequenceClassification" if family == "gemma2"
                  else "Gemma3TextForSequenceClassification")
    theirs = cls.from_pretrained(folder, num_labels=3, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs.score.weight.copy_(ours.score.weight)
    ids = torch.randint(1, VOCAB, (2, 2 * WINDOW + 2))
    mask = torch.ones_like(ids)
    ids[1, -3:], mask[1, -3:] = 0, 0
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, mask), theirs(input_ids=ids, attention_mask=mask).logits,
                                   atol=1e-4, rtol=0)


def llama_cpp_shaped(family: str, **overrides):
    """A tiny Gemma as llama.cpp lays the architecture out (its layer pattern, local RoPE base, attention scale)."""
    layers = 7 if family == "gemma3_text" else 3
    every = 6 if family == "gemma3_text" else 2
    extra: dict = dict(num_hidden_layers=layers, query_pre_attn_scalar=16,
                       layer_types=["sliding_attention" if (i + 1) % every else "full_attention"
                                    for i in range(layers)])
    if family == "gemma3_text":
        extra["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    return make_gemma(family, **{**extra, **overrides})


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_export_is_laid_out_as_llama_cpp_s_and_loads_back(family, tmp_path):
    """write_gguf of a Gemma: the gguf package's tensor names for gemma2/gemma3, norms stored plus one, the window
    and soft caps in the metadata; entrenar.load of the file gives transformers' logits."""
    import gguf

    import entrenar
    from entrenar.export.gguf_write import write_gguf

    tokenizer = chat_tokenizer()
    ref = llama_cpp_shaped(family, vocab_size=320)
    ref.save_pretrained(tmp_path / "hf")
    path = write_gguf(load_hf(tmp_path / "hf"), tokenizer, tmp_path / "m.gguf", "f32")

    reader = gguf.GGUFReader(path)
    arch = gguf.MODEL_ARCH.GEMMA2 if family == "gemma2" else gguf.MODEL_ARCH.GEMMA3
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    names = gguf.get_tensor_name_map(arch, ref.config.num_hidden_layers)
    stored = {t.name: torch.from_numpy(t.data.copy()).reshape([int(d) for d in reversed(t.shape.tolist())])
              for t in reader.tensors}
    expected = {names.get_name(n, try_suffixes=(".weight",)): t + (1 if n.endswith("norm.weight") else 0)
                for n, t in ref.state_dict().items() if n != "lm_head.weight"}
    assert stored.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(stored[name], tensor.detach(), msg=name)
    fields = reader.fields
    assert int(fields[f"{arch_name}.attention.sliding_window"].contents()) == WINDOW
    assert fields[f"{arch_name}.final_logit_softcapping"].contents() == pytest.approx(3.0)
    model, _ = entrenar.load(path, device="cpu")
    ids = torch.randint(1, 300, (2, 3 * WINDOW), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("change", ["layer_types", "query_pre_attn_scalar", "rope_local_theta"])
def test_gguf_export_refuses_what_llama_cpp_would_run_otherwise(change, tmp_path):
    """llama.cpp fixes Gemma 3's layer pattern, local RoPE base and attention scale: a model that differs is
    refused by name, and no file is written."""
    from entrenar.errors import ModelError
    from entrenar.export.gguf_write import write_gguf

    ref = llama_cpp_shaped("gemma3_text", vocab_size=320)
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    value = {"layer_types": ("full_attention",) * 7, "query_pre_attn_scalar": 24.0, "rope_local_theta": 50.0}[change]
    model.config = model.config.replace(**{change: value})
    with pytest.raises(ModelError, match=f"gemma3_text model with {change}=.*llama.cpp's gemma3"):
        write_gguf(model, chat_tokenizer(), tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()


def test_fused_kernels_cover_gemma_s_norms_and_gate_and_the_logits_stay_transformers(gemma):
    """apply_kernels gives Gemma's (1 + w) norms the offset norm kernel and its GELU-tanh gate the geglu kernel
    (each a subclass with the same state), attention the RoPE kernel; the sandwich blocks keep their own forward
    (no norm-inside-LoRA node for Gemma's norms). The logits stay transformers' (here through the kernels'
    PyTorch paths, or Triton's interpreter)."""
    from entrenar.kernels import FusedGatedMLP, FusedOffsetRMSNorm, apply_kernels
    from entrenar.models.transformer import Attention, SandwichBlock

    family, folder, ref = gemma
    model = load_hf(folder).eval()
    changed = apply_kernels(model)
    kinds = {type(m) for n, m in model.named_modules() if n in changed}
    assert FusedOffsetRMSNorm in kinds and FusedGatedMLP in kinds and any(issubclass(k, Attention) for k in kinds)
    assert all(type(block) is SandwichBlock for block in model.model.layers)
    ids = torch.randint(1, VOCAB, (2, 2 * WINDOW))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


def test_gemma3_with_vision_is_refused_by_name():
    from entrenar.errors import ModelError
    from entrenar.models.config import ModelConfig

    with pytest.raises(ModelError, match="Gemma3ForConditionalGeneration.*gemma3_text"):
        ModelConfig.from_hf({"model_type": "gemma3", "text_config": {"hidden_size": 8}}, "x/config.json")


def test_damaged_gemma_keys_name_the_file_and_key(gemma):
    import json

    from entrenar.errors import ModelError
    from entrenar.models.config import ModelConfig

    _, folder, _ = gemma
    hf = json.loads((folder / "config.json").read_text())
    for key, value, message in [("layer_types", ["sliding_attention"], "layer_types"),
                                ("hidden_activation", "relu", "hidden_activation"),
                                ("final_logit_softcapping", -1.0, "final_logit_softcapping"),
                                ("use_bidirectional_attention", True, "use_bidirectional_attention")]:
        with pytest.raises(ModelError, match=f"cfg.json.*{message}"):
            ModelConfig.from_hf({**hf, key: value}, "cfg.json")


@pytest.mark.parametrize("family, keys", [
    ("gemma2", {}),
    ("gemma3_text", {}),
    # the Hub's older Gemma 3 configs: a pattern, rope_theta and rope_local_base_freq, rope_scaling for global layers
    ("gemma3_text", {"sliding_window_pattern": 3, "rope_theta": 200_000.0, "rope_local_base_freq": 77.0,
                     "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "query_pre_attn_scalar": 32}),
])
def test_configs_that_leave_keys_out_read_as_transformers_reads_them(family, keys):
    """What config.json leaves out takes transformers 5.24's defaults (soft caps, head_dim 256, window 4096, tied
    head, the layer pattern, the RoPE bases)."""
    import transformers

    from entrenar.models.config import ModelConfig

    minimal = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=7, num_attention_heads=4,
                   num_key_value_heads=2, **keys)
    theirs = getattr(transformers, GEMMA[family][0])(**minimal)
    ours = ModelConfig.from_hf({"model_type": family, **minimal})
    assert ours.layer_types == tuple(theirs.layer_types)
    assert (ours.head_dim, ours.sliding_window, ours.tie_word_embeddings) == (
        theirs.head_dim, theirs.sliding_window, theirs.tie_word_embeddings)
    assert (ours.attn_logit_softcapping if family == "gemma2" else None) == (
        theirs.attn_logit_softcapping if family == "gemma2" else None)
    assert (ours.final_logit_softcapping, ours.query_pre_attn_scalar) == (
        theirs.final_logit_softcapping, theirs.query_pre_attn_scalar)
    rope = theirs.rope_parameters
    if family == "gemma2":
        assert ours.rope_theta == rope["rope_theta"] and ours.rope_local_theta is None
    else:
        assert ours.rope_theta == rope["full_attention"]["rope_theta"]
        assert ours.rope_local_theta == rope["sliding_attention"]["rope_theta"]
        scaling = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
        assert (ours.rope_scaling or {"rope_type": "default"}) == scaling


def test_our_adapter_loads_in_peft_with_equal_logits(gemma, tmp_path):
    import peft

    from entrenar.adapters.lora import LoraConfig, apply_lora, lora_layers, save_adapter

    family, folder, ref = gemma
    model = load_hf(folder).eval()
    cfg = LoraConfig(r=4, alpha=8, target_modules="all-linear")
    apply_lora(model, cfg)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=generator) * 0.1)
    save_adapter(model, tmp_path / "adapter", cfg)
    theirs = peft.PeftModel.from_pretrained(ref, tmp_path / "adapter").eval()
    ids = torch.randint(1, VOCAB, (2, 2 * WINDOW + 1))
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        assert (expected - make_gemma(family)(ids).logits).abs().max() > 1e-3  # the adapter changes the logits
        torch.testing.assert_close(model(ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len", [48, 160])
def test_activation_estimate_within_10_percent_of_saved_tensors(family, dtype, seq_len):
    """The plan's and inspect's activation estimate against what autograd keeps: Gemma's four eager norms, and
    Gemma 2's explicit soft-capped attention, whose probabilities grow with the square of the sequence."""
    from entrenar.models.config import ModelConfig
    from entrenar.models.transformer import Transformer
    from entrenar.train.memory import estimate_training_memory
    from test_memory import measured_saved_bytes

    config = ModelConfig.from_hf(dict(model_type=family, vocab_size=256, hidden_size=128, intermediate_size=352,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=32, sliding_window=16, query_pre_attn_scalar=32))
    model = Transformer(config).to(dtype)
    model.reset_parameters()
    measured = measured_saved_bytes(model, torch.randint(0, 256, (2, seq_len)))
    est = estimate_training_memory(config, "full", 2, seq_len, dtype_bytes=dtype.itemsize)
    assert abs(est.activations - measured) / measured < 0.10, (est.activations, measured)


@pytest.mark.skipif(not (torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1"),
                    reason="the Gemma kernels' saved tensors need Triton (CUDA, or TRITON_INTERPRET=1)")
def test_kernel_path_activation_estimate_within_10_percent_of_saved_tensors():
    """LoRA on Gemma 3 with every kernel applied (the offset norm, geglu and RoPE kernels): what autograd keeps
    against the estimate with ``kernels=True``, which is below the eager one."""
    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.kernels import apply_kernels, triton_available
    from entrenar.models.config import ModelConfig
    from entrenar.models.transformer import Transformer
    from entrenar.train.memory import estimate_training_memory
    from test_memory import measured_saved_bytes

    if not triton_available():
        pytest.skip("no Triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = ModelConfig.from_hf(dict(model_type="gemma3_text", vocab_size=256, hidden_size=128,
                                      intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, sliding_window=16, query_pre_attn_scalar=32))
    model = Transformer(config).to(device, torch.bfloat16)
    model.reset_parameters()
    apply_lora(model, LoraConfig(r=8, alpha=16.0))
    apply_kernels(model)
    measured = measured_saved_bytes(model, torch.randint(0, 256, (2, 64), device=device))
    est = estimate_training_memory(config, "lora", 2, 64, dtype_bytes=2, lora_r=8, kernels=True)
    eager = estimate_training_memory(config, "lora", 2, 64, dtype_bytes=2, lora_r=8)
    assert abs(est.activations - measured) / measured < 0.10, (est.activations, measured)
    assert est.activations < 0.8 * eager.activations


def test_batched_generation_matches_transformers(gemma):
    """Embeddings scaled, scores and logits soft-capped, global and sliding layers (Gemma 3: their own RoPE base)
    in the KV-cache sampler too, eager and on the static cache."""
    _, folder, ref = gemma
    check_batched_generation(load_hf(folder).eval(), ref, vocab=VOCAB)
