"""Preference pairs with the prompt computed once (task.share_prompt): the same log-probabilities, losses, metrics
and gradients as the two unshared sequences, on a GQA Llama and a soft-capped, sliding-window Gemma 2, through the
task, the reference models, accumulation, the trainer and a resume."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from conftest import crash_after_step, make_hf_model, nonzero_adapters
from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.adapters.switch import adapters_off
from entrenar.config import load_recipe
from entrenar.data import padding_free
from entrenar.data.preference import PreferencePair, collate_preference, shared_prompt_layout
from entrenar.distributed.parallelize import Single
from entrenar.errors import ConfigError
from entrenar.loading import load
from entrenar.tasks.preference import PreferenceTask, share_prompt_of
from entrenar.tasks.preference.logprobs import sequence_logprobs
from entrenar.tasks.preference.task import SHARE_PROMPT_MIN_HIDDEN
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics


def _pairs(n=4, seed=3, vocab=96):
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(3, vocab, (k,), generator=g).tolist()

    # prompts and completions long enough that a window of 5 cuts them
    return [PreferencePair(ids(4 + i % 3), ids(5 + i % 2), ids(3 + i % 4)) for i in range(n)]


def _gemma2_folder(tmp_path):
    """A tiny Gemma 2 (scores soft-capped, sliding window 5 on two of three layers: the per-document path)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=5, initializer_range=0.2,
        pad_token_id=0, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = transformers.Gemma2ForCausalLM(config).eval()
    folder = tmp_path / "gemma2"
    model.save_pretrained(folder)
    return folder


@pytest.fixture(params=["llama", "gemma2"])
def family(request, tmp_path):
    if request.param == "llama":  # 4 query heads over 2 key/value heads (GQA)
        folder = tmp_path / "llama"
        make_hf_model("llama", vocab_size=96).save_pretrained(folder)
    else:
        folder = _gemma2_folder(tmp_path)
    return request.param, folder


def _lora(folder):
    model, _ = load(folder, dtype="float32", device="cpu")
    base = copy.deepcopy(model).eval()
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    nonzero_adapters(model)
    return model, base


def _recipe(tmp_path, folder, *overrides):
    (tmp_path / "r.yaml").write_text(f"""
model: {{path: {folder}, device: cpu}}
data: {{train: {tmp_path / 'unused.jsonl'}, seq_len: 32}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
task: {{type: preference}}
""")
    return load_recipe(tmp_path / "r.yaml", list(overrides))


def _leaky(batch):
    """The shared layout with the rejected tokens also seeing the chosen ones (keys [prompt, chosen, rejected]):
    what the tests must tell apart from the real one."""
    cu_q = batch["shared_cu_seqlens"].tolist()
    kv, cu_k = [], [0]
    for i in range(0, len(cu_q) - 1, 2):
        start, mid, end = cu_q[i], cu_q[i + 1], cu_q[i + 2]
        kv += list(range(start, mid)) + list(range(start, end))
        cu_k.append(cu_k[-1] + mid - start)
        cu_k.append(cu_k[-1] + end - start)
    return {**batch, "shared_kv_index": torch.tensor(kv), "shared_cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32),
            "shared_max_seqlen_k": max(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))}


def test_layout_positions_keys_and_targets_are_those_of_the_unshared_sequences():
    pair = PreferencePair([10, 11, 12], [20, 21], [30, 31, 32, 33])
    out = shared_prompt_layout([pair, PreferencePair([40], [50], [60])])
    p, c, r = 3, 2, 4
    assert out["shared_input_ids"].tolist() == [10, 11, 12, 20, 21, 30, 31, 32, 33, 40, 50, 60]
    # rejected continues from the prompt's end, as in [prompt, rejected]
    assert out["shared_position_ids"].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 0, 1, 1]
    assert out["shared_cu_seqlens"].tolist() == [0, p + c, p + c + r, 11, 12]
    # rejected's keys: the prompt gathered again, then its own tokens; never chosen's (indices 3, 4)
    kv = out["shared_kv_index"].tolist()
    assert kv[:p + c] == [0, 1, 2, 3, 4] and kv[p + c:p + c + p + r] == [0, 1, 2, 5, 6, 7, 8]
    assert out["shared_cu_seqlens_k"].tolist() == [0, 5, 12, 14, 16]
    # rejected's first token from the prompt's last hidden state, then from its own positions
    assert out["shared_sources"].tolist() == [2, 3, 2, 5, 6, 7, 9, 9]
    assert out["shared_targets"].tolist() == [20, 21, 30, 31, 32, 33, 50, 60]
    assert out["shared_owners"].tolist() == [0, 0, 1, 1, 1, 1, 2, 3]
    assert out["shared_tokens"] == 12 and out["shared_counted_tokens"] == 2 * 3 + 2 + 4 + 2 * 1 + 1 + 1
    assert (out["shared_max_seqlen"], out["shared_max_seqlen_k"]) == (5, 7)


def test_shared_logprobs_equal_the_unshared_sequences(family):
    """Each sequence's summed log-probability and token count, and the gradients they send back, are the unshared
    sequences' (fp32); a layout where rejected saw chosen would not be."""
    name, folder = family
    model, _ = _lora(folder)
    pairs = _pairs()
    batch = collate_preference(pairs, range(4), 32, share_prompt=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    results = []
    for shared in (False, True):
        model.zero_grad()
        sums, tokens = sequence_logprobs(model, batch, model.lm_head if name == "llama" else None, shared=shared)
        (sums * torch.linspace(0.5, 1.5, len(sums))).sum().backward()
        results.append((sums.detach(), tokens, [p.grad.clone() for p in trainable]))
    (a, ta, ga), (b, tb, gb) = results
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert torch.equal(ta, tb) and tb.tolist() == [len(s) for p in pairs for s in p.sequences()]
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        leaky, _ = sequence_logprobs(model, _leaky(batch), model.lm_head if name == "llama" else None, shared=True)
    torch.testing.assert_close(leaky[0::2], a[0::2], rtol=1e-5, atol=1e-5)  # chosen unchanged
    assert (leaky[1::2] - a[1::2]).abs().min() > 1e-3  # every rejected sequence would move


def test_shared_logprobs_equal_transformers(family):
    """Against transformers' own model on each unshared sequence (the reference nobody here wrote)."""
    import transformers

    _, folder = family
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    model, _ = load(folder, dtype="float32", device="cpu")
    pairs = _pairs()
    with torch.no_grad():
        ours, _ = sequence_logprobs(model, collate_preference(pairs, range(4), 32, share_prompt=True), None,
                                    shared=True)
        expected = []
        for p in pairs:
            for completion in p.sequences():
                ids = torch.tensor([p.prompt + completion])
                logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1)
                expected.append(logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(p.prompt) - 1:].sum())
    torch.testing.assert_close(ours, torch.stack(expected), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("loss", ["dpo", "orpo"])
def test_loss_metrics_and_gradients_equal_share_prompt_off(family, tmp_path, loss):
    """Through the task on the padding-free batch the Trainer hands it: auto shares the prompt, false does not; the
    loss, TRL's metrics (ORPO's nll_loss on chosen too) and the adapters' gradients agree."""
    _, folder = family
    model, _ = _lora(folder)
    trainable = [p for p in model.parameters() if p.requires_grad]
    flat = padding_free(collate_preference(_pairs(), range(4), 32, share_prompt=True))
    runs = []
    for setting in ("false", "auto"):
        task = PreferenceTask(_recipe(tmp_path, folder, f"task.loss={loss}", f"task.share_prompt={setting}"))
        task.prepare(model)
        assert task._shared(flat) == (setting == "auto")
        model.zero_grad()
        value = task.loss_sum(Single(model), flat)
        value.backward()
        runs.append((value.detach(), task.step_metrics(), [p.grad.clone() for p in trainable]))
    (la, ma, ga), (lb, mb, gb) = runs
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)
    assert set(ma) == set(mb) and ("nll_loss" in ma) == (loss == "orpo")
    for key in ma:
        torch.testing.assert_close(mb[key], ma[key], rtol=1e-5, atol=1e-6)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)


def test_adapters_off_reference_through_the_shared_layout_equals_a_frozen_copy(family):
    name, folder = family
    model, base = _lora(folder)
    batch = collate_preference(_pairs(), range(4), 32, share_prompt=True)
    head = (lambda m: m.lm_head) if name == "llama" else (lambda m: None)
    with torch.no_grad():
        with adapters_off(model):
            off, _ = sequence_logprobs(model, batch, head(model), shared=True)
        copied, _ = sequence_logprobs(base, batch, head(base), shared=True)
        unshared, _ = sequence_logprobs(base, batch, head(base))
    torch.testing.assert_close(off, copied, rtol=0, atol=0)
    torch.testing.assert_close(copied, unshared, rtol=1e-5, atol=1e-5)


def test_accumulated_shared_micro_batches_equal_one_large_batch(tmp_path):
    folder = tmp_path / "llama"
    make_hf_model("llama", vocab_size=96).save_pretrained(folder)
    model, _ = _lora(folder)
    task = PreferenceTask(_recipe(tmp_path, folder, "task.share_prompt=true"))
    task.prepare(model)
    examples = _pairs()
    trainable = [p for p in model.parameters() if p.requires_grad]

    def run(groups):
        model.zero_grad()
        batches = [collate_preference(examples, g, 32, share_prompt=True) for g in groups]
        assert all(task._shared(b) for b in batches)
        step_targets = sum(task.num_targets(b) for b in batches)
        total = sum(task.loss_sum(Single(model), b) / step_targets for b in batches)
        total.backward()
        return total.detach(), [p.grad.clone() for p in trainable], task.step_metrics()

    one, two = run([range(4)]), run([range(2), range(2, 4)])
    torch.testing.assert_close(one[0], two[0])
    for a, b in zip(one[1], two[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for key in one[2]:
        torch.testing.assert_close(one[2][key], two[2][key])


@pytest.mark.parametrize(("overrides", "message"), [
    (["task.share_prompt=true", "task.loss=kto"], "task.loss kto has unpaired examples"),
    (["task.share_prompt=true", "data.padding_free=false"], "'data.padding_free' is false"),
    (["task.share_prompt=always"], "'task.share_prompt' must be one of"),
])
def test_share_prompt_settings_that_cannot_hold_are_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _recipe(tmp_path, tmp_path / "model", *overrides)


def test_share_prompt_applies_to_preference_tasks_only(tmp_path):
    (tmp_path / "c.yaml").write_text(f"model: {{path: {tmp_path}, device: cpu}}\n"
                                     f"data: {{train: {tmp_path / 'x.jsonl'}}}\n")
    with pytest.raises(ConfigError, match="task.type is causal_lm"):
        load_recipe(tmp_path / "c.yaml", ["task.share_prompt=true"])


@pytest.mark.parametrize(("setting", "hidden", "device", "shared"), [
    ("auto", 2048, "cuda", False),  # a small model's GPU step waits on launches: two sequences measured faster
    ("auto", 4096, "cuda", True),
    ("auto", 2048, "cpu", True),  # a CPU step is bound by the work it saves
    ("auto", None, "cuda", True),  # width not known: the layout the rows allow
    ("true", 2048, "cuda", True),  # as set
    ("false", 8192, "cuda", False),
])
def test_auto_shares_prompts_where_the_measurement_says_it_pays(tmp_path, setting, hidden, device, shared):
    recipe = _recipe(tmp_path, tmp_path / "model", f"task.share_prompt={setting}")
    decided, why = share_prompt_of(recipe, True, hidden, device)
    assert decided is shared
    assert ("computed once" in why) is shared
    if setting == "auto" and not shared:
        assert f"< {SHARE_PROMPT_MIN_HIDDEN}" in why


# -- through the trainer ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from conftest import make_workspace

    root = make_workspace(tmp_path_factory.mktemp("share"))
    with open(root / "pairs.jsonl", "w") as f:
        for a in range(20):
            f.write(json.dumps({"prompt": f"What is {a} plus {a % 7}? Answer:", "chosen": f" {a + a % 7}.",
                                "rejected": f" it is {a * 3 + 1}, I think."}) + "\n")
    return root


def _train_recipe(ws, name, *overrides):
    path = ws / f"{name}.yaml"
    path.write_text(f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'pairs.jsonl'}, seq_len: 48, validation_split: 0.0, shuffle: true}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
task: {{type: preference, loss: dpo}}
optimizer: {{lr: 2.0e-2}}
schedule: {{warmup_steps: 0}}
training: {{max_steps: 4, batch_size: 2, grad_accum: 2, eval_every: 0, log_every: 1, save_every: 2}}
output: {{dir: {ws / name}}}
""")
    return load_recipe(path, list(overrides))


def _steps(folder):
    return [r for r in read_metrics(folder / "metrics.jsonl") if "loss" in r and "eval_loss" not in r]


def test_trainer_runs_shared_and_unshared_alike_and_resumes(ws, monkeypatch):
    """`entrenar train` with the prompt shared logs the losses, TRL's metrics and tokens of the unshared run (tokens
    counted as TRL processes them), says which layout it runs, and a crashed run resumes to the same steps."""
    shared = _train_recipe(ws, "shared", "task.share_prompt=true")
    dry = train(shared, dry_run=True)
    assert "its prompt computed once (task.share_prompt: true)" in dry.summary
    off = _train_recipe(ws, "off", "task.share_prompt=false")
    assert "[prompt, rejected] (task.share_prompt: false)" in train(off, dry_run=True).summary
    result = train(shared, progress=False)
    train(off, progress=False)
    a, b = _steps(ws / "shared"), _steps(ws / "off")
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert x["tokens"] == y["tokens"]  # the prompt counted twice either way
        for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), key
    assert "tokens computed" in result.summary

    crashed = dataclasses.replace(shared, output=dataclasses.replace(shared.output, dir=str(ws / "crashed")))
    crash_after_step(monkeypatch, crashed, 3)
    train(crashed, resume=True, progress=False)
    c = _steps(ws / "crashed")
    assert [r["step"] for r in c][-1] == 4
    last = {r["step"]: r for r in c}
    for r in a:
        assert last[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-5, abs=1e-6)
