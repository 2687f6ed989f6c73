"""PreferenceTask on entrenar's model: the adapter-off reference, packing, accumulation, settings and refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import nonzero_adapters
from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.adapters.switch import adapters_off
from entrenar.config import load_recipe
from entrenar.data.preference import PreferencePair, collate_preference
from entrenar.distributed.parallelize import Single
from entrenar.errors import AdapterError, CheckpointError, ConfigError
from entrenar.loading import load
from entrenar.tasks import for_recipe
from entrenar.tasks.preference import PreferenceTask, reference_of
from entrenar.tasks.preference.logprobs import sequence_logprobs


def _pairs(n=4, seed=3):
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(3, 128, (k,), generator=g).tolist()

    return [PreferencePair(ids(2 + i % 3), ids(3 + i % 2), ids(2 + i % 4)) for i in range(n)]


def _recipe(tmp_path, folder, *overrides, lora=True):
    (tmp_path / "r.yaml").write_text(f"""
model: {{path: {folder}, device: cpu}}
data: {{train: {tmp_path / 'unused.jsonl'}, seq_len: 32}}
{'lora: {r: 4, alpha: 8, target_modules: all-linear}' if lora else ''}
task: {{type: preference}}
""")
    return load_recipe(tmp_path / "r.yaml", list(overrides))


@pytest.fixture
def lora_model(hf_folder):
    folder, _ = hf_folder("llama")
    model, _ = load(folder, dtype="float32", device="cpu")
    base = copy.deepcopy(model).eval()
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    nonzero_adapters(model)
    return folder, model, base


def test_adapters_off_reference_equals_a_separate_frozen_copy(lora_model):
    _, model, base = lora_model
    batch = collate_preference(_pairs(), range(4), 32, packing=True)
    with torch.no_grad():
        adapted, _ = sequence_logprobs(model, batch, model.lm_head)
        with adapters_off(model):
            off, tokens = sequence_logprobs(model, batch, model.lm_head)
        copy_logps, copy_tokens = sequence_logprobs(base, batch, base.lm_head)
    torch.testing.assert_close(off, copy_logps, rtol=0, atol=0)  # the same products: bit for bit
    assert torch.equal(tokens, copy_tokens)
    assert not torch.allclose(adapted, off)  # the adapters were on outside the block, and are again
    with torch.no_grad():
        again, _ = sequence_logprobs(model, batch, model.lm_head)
    torch.testing.assert_close(again, adapted, rtol=0, atol=0)


def test_adapters_off_refuses_a_model_without_lora(lora_model):
    _, _, base = lora_model
    with pytest.raises(AdapterError, match="no LoRA layers"), adapters_off(base):
        pass


def test_sequence_logprobs_equal_transformers_log_softmax(lora_model):
    """The per-sequence sums are the completion tokens' log-probabilities under transformers' own logits."""
    import transformers

    folder, _, base = lora_model
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pairs = _pairs()
    batch = collate_preference(pairs, range(4), 32, packing=True)
    with torch.no_grad():
        ours, tokens = sequence_logprobs(base, batch, base.lm_head, chunk=5)
        expected = []
        for p in pairs:
            for completion in p.sequences():
                ids = torch.tensor([p.prompt + completion])
                logp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1)
                targets = ids[0, 1:]
                expected.append(logp[torch.arange(len(targets)), targets][len(p.prompt) - 1:].sum())
    torch.testing.assert_close(ours, torch.stack(expected), rtol=1e-5, atol=1e-5)
    assert tokens.tolist() == [len(c) for p in pairs for c in p.sequences()]


@pytest.mark.parametrize("loss", ["dpo", "simpo", "kto"])
def test_packed_and_padded_batches_give_the_same_loss(lora_model, tmp_path, loss):
    folder, model, _ = lora_model
    task = PreferenceTask(_recipe(tmp_path, folder, f"task.loss={loss}"))
    task.prepare(model)
    examples = _pairs()
    if loss == "kto":
        from entrenar.data.preference import UnpairedExample
        examples = [UnpairedExample(p.prompt, p.chosen, i % 2 == 0) for i, p in enumerate(examples)]
    values = []
    for packing in (True, False):
        batch = collate_preference(examples, range(4), 32, packing=packing, kl=loss == "kto")
        values.append(task.loss_sum(Single(model), batch))
    rows = [collate_preference(examples, range(4), 32, packing=p, kl=loss == "kto")["input_ids"].shape[0]
            for p in (True, False)]
    assert rows[0] < rows[1]  # packing did pack
    torch.testing.assert_close(values[0], values[1], rtol=1e-5, atol=1e-6)


def test_accumulated_micro_batches_equal_one_large_batch(lora_model, tmp_path):
    """The step divides each micro-batch's summed loss by the step's pairs: two micro-batches of two pairs give the
    loss and gradients of one batch of four."""
    folder, model, _ = lora_model
    task = PreferenceTask(_recipe(tmp_path, folder))
    task.prepare(model)
    examples = _pairs()
    trainable = [p for p in model.parameters() if p.requires_grad]

    def run(groups):
        model.zero_grad()
        batches = [collate_preference(examples, g, 32) for g in groups]
        step_targets = sum(task.num_targets(b) for b in batches)
        total = sum(task.loss_sum(Single(model), b) / step_targets for b in batches)
        total.backward()
        return total.detach(), [p.grad.clone() for p in trainable], task.step_metrics()

    one = run([range(4)])
    two = run([range(2), range(2, 4)])
    torch.testing.assert_close(one[0], two[0])
    for a, b in zip(one[1], two[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for key in one[2]:
        torch.testing.assert_close(one[2][key], two[2][key])


def test_reference_resolution(tmp_path, hf_folder):
    folder, _ = hf_folder("llama")
    assert reference_of(_recipe(tmp_path, folder))[0] == "adapters_off"
    assert reference_of(_recipe(tmp_path, folder, lora=False))[0] == "copy"
    assert reference_of(_recipe(tmp_path, folder, "task.reference=copy"))[0] == "copy"
    assert reference_of(_recipe(tmp_path, folder, "task.loss=simpo"))[0] == "none"
    assert isinstance(for_recipe(_recipe(tmp_path, folder)), PreferenceTask)


@pytest.mark.parametrize(("overrides", "lora", "message"), [
    (["task.loss=dpp"], True, r"'task.loss' must be one of: dpo, ipo, simpo, orpo, kto, got 'dpp' "
                              r"\(did you mean 'dpo'\?\)"),
    (["task.loss=simpo", "task.reference=adapters_off"], True, "task.loss simpo is reference-free"),
    (["task.loss=orpo", "task.reference=copy"], True, "task.loss orpo is reference-free"),
    (["task.simpo_gamma=1.0"], True, "'task.simpo_gamma' applies to task.loss simpo"),
    (["task.desirable_weight=2"], True, "'task.desirable_weight' applies to task.loss kto"),
    (["task.loss=ipo", "task.label_smoothing=0.1"], True, "'task.label_smoothing' applies to task.loss dpo or simpo"),
    (["task.label_smoothing=0.5"], True, r"must be in \[0, 0.5\)"),
    (["task.beta=0"], True, "'task.beta' must be a number > 0"),
    (["task.reference=adapters_off"], False, "adapters_off needs LoRA or QLoRA"),
    (["task.type=causal_lm", "task.beta=0.2"], True, "'task.beta' is a preference setting"),
])
def test_nonsense_settings_are_refused_naming_the_key(tmp_path, hf_folder, overrides, lora, message):
    folder, _ = hf_folder("llama")
    with pytest.raises(ConfigError, match=message):
        _recipe(tmp_path, folder, *overrides, lora=lora)


def test_precomputed_reference_equals_a_frozen_copy_and_is_reused(hf_folder, tmp_path):
    """Full fine-tuning: the table computed once from the starting weights gives the copy's loss; a second run in
    the folder reuses it; a model that left its starting weights without a table is refused."""
    folder, _ = hf_folder("llama")
    pairs = _pairs()
    batch = collate_preference(pairs, range(4), 32)

    def task_for(reference):
        recipe = _recipe(tmp_path, folder, f"task.reference={reference}", f"output.dir={tmp_path / 'run'}",
                         lora=False)
        model, _ = load(folder, dtype="float32", device="cpu")
        task = PreferenceTask(recipe)
        task.prepare(model)
        task.reference.examples.extend(pairs)
        task.stream(pairs, SimpleTokenizer())
        return task, model

    def move(model):  # the policy leaves its starting weights (the same way both times)
        torch.manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)

    copied, model = task_for("copy")
    move(model)  # the copy stays where it started
    expected = copied.loss_sum(Single(model), batch)

    fresh, model = task_for("precomputed")
    path = tmp_path / "run" / "reference_logps.safetensors"
    fresh.reference.precomputed()
    assert path.is_file()
    move(model)
    torch.testing.assert_close(fresh.loss_sum(Single(model), batch), expected, rtol=1e-5, atol=1e-6)

    stamp = path.stat().st_mtime_ns
    again, _ = task_for("precomputed")
    again.reference.precomputed()
    assert path.stat().st_mtime_ns == stamp  # reused, not recomputed

    path.unlink()
    resumed, model = task_for("precomputed")
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # what a resume's checkpoint does to the weights
    with pytest.raises(CheckpointError, match="left its starting weights"):
        resumed.reference.precomputed()


class SimpleTokenizer:
    pad_id = 0


def test_padding_free_layout_keeps_the_sequences_and_the_loss(lora_model, tmp_path):
    """The Trainer's padding-free layout (data.padding_free) lays sequence_ids out as the tokens, so the loss over one
    row of real tokens is the packed batch's."""
    from entrenar.data import padding_free

    folder, model, _ = lora_model
    task = PreferenceTask(_recipe(tmp_path, folder))
    task.prepare(model)
    batch = collate_preference(_pairs(), range(4), 32, packing=True)
    flat = padding_free(batch)
    assert flat["sequence_ids"].shape == flat["input_ids"].shape and flat["num_sequences"] == 8
    torch.testing.assert_close(task.loss_sum(Single(model), flat), task.loss_sum(Single(model), batch),
                               rtol=1e-5, atol=1e-6)
