"""Training an adapter further (``model.path`` a PEFT adapter folder or a LoRA run): step by step as PEFT trains
it, saved against the right base, and any other adapter refused naming the key."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from conftest import crash_after_step, make_workspace
from entrenar.adapters.lora import lora_layers
from entrenar.config import load_recipe
from entrenar.data import BatchStream, read_records, split_validation, tokenize_records
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import AdapterError, ConfigError
from entrenar.loading import load
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics

STEPS, SEQ, LR = 8, 64, 1e-2


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """A tiny model folder, documents of 5-40 characters (several to a packed row) and a PEFT adapter drawn
    on it, its B non-zero so that both factors train from the first step."""
    import peft
    import transformers

    ws = make_workspace(tmp_path_factory.mktemp("continue"))
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz +="
    with open(ws / "docs.jsonl", "w") as f:
        for _ in range(60):
            f.write(json.dumps({"text": "".join(rng.choice(letters) for _ in range(rng.randint(5, 40)))}) + "\n")
    base = transformers.AutoModelForCausalLM.from_pretrained(ws / "model", dtype=torch.float32)
    torch.manual_seed(0)
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    adapted.save_pretrained(ws / "adapter")
    return ws


def _recipe(ws, run: str, *overrides: str, lora: str = "{r: 4, alpha: 8, target_modules: all-linear}"):
    path = ws / f"{run}.yaml"
    path.write_text(f"""
model: {{path: {ws / 'adapter'}, device: cpu}}
data: {{train: {ws / 'docs.jsonl'}, seq_len: {SEQ}, validation_split: 0.0, packing: true, train_on: all}}
lora: {lora}
optimizer: {{lr: {LR}}}
schedule: {{name: constant, warmup_steps: 0}}
training: {{max_steps: {STEPS}, batch_size: 2, precision: fp32, max_grad_norm: 1.0, log_every: 1}}
output: {{dir: {ws / run}}}
""")
    return load_recipe(path, list(overrides))


def _batches(ws, recipe) -> list[dict]:
    """The batches the run trains on, made as the loop makes them (same reader, packing, seed)."""
    tokenizer = Tokenizer.from_folder(ws / "model")
    records, _ = read_records(str(ws / "docs.jsonl"), format="auto", on_error="raise")
    examples, _ = tokenize_records(records, tokenizer, SEQ, train_on="all", add_eos=True,
                                   columns={"text": "text", "prompt": "prompt", "completion": "completion",
                                            "messages": "messages"}, on_error="raise")
    examples, _ = split_validation(examples, 0.0, seed=recipe.training.seed)
    stream = BatchStream(examples, 2, SEQ, packing=True, shuffle=True, seed=recipe.training.seed,
                         pad_id=tokenizer.pad_id or 0)
    return [next(stream) for _ in range(STEPS)]


def _peft_steps(ws, batches: list[dict]):
    """PEFT's model from the same adapter, trained on the same batches as HF Trainer's step does it (mean loss,
    clipping at 1.0, AdamW without decay), each document attending only to itself (a block-diagonal causal mask
    and positions from each document's start). Returns (model, losses)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(ws / "model", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, ws / "adapter", is_trainable=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    losses = []
    for batch in batches:
        docs = batch["document_ids"]
        n = docs.shape[1]
        allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
        allowed |= torch.eye(n, dtype=torch.bool)  # a padding position attends to itself (its label is ignored)
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[:, None]
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"], attention_mask=mask,
                     position_ids=batch["position_ids"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def test_training_a_peft_adapter_further_follows_peft_step_by_step(started):
    """`entrenar train` from a PEFT adapter folder: at each of 8 AdamW steps PEFT's loss on the same packed rows
    (several documents to a row, each attending to itself), the same final adapter, saved against the base model
    (not the adapter folder), and that adapter loads in PEFT with the trained model's logits."""
    import peft
    import transformers

    ws = started
    recipe = _recipe(ws, "run")
    batches = _batches(ws, recipe)
    assert max(int(b["document_ids"].max()) for b in batches) >= 2  # rows of several documents
    train(recipe)
    ours = [r["loss"] for r in read_metrics(ws / "run" / "metrics.jsonl") if "loss" in r]
    reference, theirs = _peft_steps(ws, batches)
    assert len(ours) == STEPS
    assert ours == pytest.approx(theirs, abs=2e-5, rel=0)
    assert ours[-1] < ours[0] - 0.1  # it trained

    saved = ws / "run" / "adapter"
    assert json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"] == str(ws / "model")
    base = transformers.AutoModelForCausalLM.from_pretrained(ws / "model", dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, saved)
    ids = batches[0]["input_ids"][:1, :16]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


def test_a_run_that_trained_an_adapter_further_loads_on_its_base(started):
    """The run's folder loads as base + the run's adapter (its recipe's model.path is the adapter folder it
    started from, whose base is the run's base too), and a run can start from that run in turn."""
    ws = started
    train(_recipe(ws, "first", "training.max_steps=2", f"output.dir={ws / 'first'}"))
    model, _ = load(ws / "first")
    assert len(list(lora_layers(model))) == 14  # one adapter: the run's, on the plain base
    second = _recipe(ws, "second", "training.max_steps=2", f"model.path={ws / 'first'}")
    train(second)
    saved = json.loads((ws / "second" / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(ws / "model")


def test_a_run_from_an_adapter_resumes_bit_for_bit(started, monkeypatch):
    """Interrupted after step 6 with its checkpoint at step 4, a run from a PEFT adapter resumes onto that
    adapter's base and logs the uninterrupted run's losses exactly."""
    ws = started
    straight = _recipe(ws, "straight", f"output.dir={ws / 'straight'}", "training.save_every=4")
    train(straight)
    expected = [r["loss"] for r in read_metrics(ws / "straight" / "metrics.jsonl") if "loss" in r]
    recipe = _recipe(ws, "cut", f"output.dir={ws / 'cut'}", "training.save_every=4")
    crash_after_step(monkeypatch, recipe, 6)
    train(recipe, resume=True)
    assert [r["loss"] for r in read_metrics(ws / "cut" / "metrics.jsonl") if "loss" in r] == expected


@pytest.mark.parametrize(("lora", "message"), [
    ("{r: 8, alpha: 8, target_modules: all-linear}", "lora.r: 8, but the adapter"),
    ("{r: 4, alpha: 16, target_modules: all-linear}", "lora.alpha: 16.0, but the adapter"),
    ("{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}", "lora.target_modules: selects other layers"),
])
def test_a_lora_section_describing_another_adapter_is_refused_naming_the_key(started, lora, message):
    ws = started
    with pytest.raises(AdapterError, match=message.replace(".", r"\.")):
        train(_recipe(ws, "other", lora=lora))
    assert not (ws / "other" / "adapter").exists()


def test_preference_training_from_an_adapter_takes_it_as_the_reference(started):
    """DPO from an SFT adapter (model.path): the reference is the starting policy, base and adapter (TRL's
    ref_adapter_name setting), so the first step's loss is ln 2 exactly; the bare base (adapters off, chosen
    explicitly) is another model, whose first loss is not."""
    ws = started
    with open(ws / "pairs.jsonl", "w") as f:
        for a in range(24):
            f.write(json.dumps({"prompt": f"{a}+{a % 7}=", "chosen": str(a + a % 7), "rejected": str(a * 3 + 1)})
                    + "\n")
    first = {}
    for reference in ("auto", "adapters_off"):
        path = ws / f"dpo-{reference}.yaml"
        path.write_text(f"""
model: {{path: {ws / 'adapter'}, device: cpu}}
data: {{train: {ws / 'pairs.jsonl'}, seq_len: 32, validation_split: 0.0}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
task: {{type: preference, reference: {reference}}}
optimizer: {{lr: 1.0e-2}}
training: {{max_steps: 2, batch_size: 2, precision: fp32, log_every: 1}}
output: {{dir: {ws / f'dpo-{reference}'}}}
""")
        train(load_recipe(path))
        first[reference] = next(r["loss"] for r in read_metrics(ws / f"dpo-{reference}" / "metrics.jsonl")
                                if "loss" in r)
    assert first["auto"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(first["adapters_off"] - math.log(2)) > 1e-3


def test_grpo_with_a_kl_term_from_an_adapter_is_refused_naming_the_key(started):
    """GRPO's KL reference is the model with its adapters off: from an adapter that would be the bare base, not
    the policy training starts from, so kl_beta > 0 there is refused, naming it; kl_beta 0 trains."""
    ws = started
    with open(ws / "sums.jsonl", "w") as f:
        for a in range(12):
            f.write(json.dumps({"prompt": f"{a}+1=", "completion": str(a + 1)}) + "\n")
    for beta in (0.04, 0.0):
        path = ws / f"grpo-{beta}.yaml"
        path.write_text(f"""
model: {{path: {ws / 'adapter'}, device: cpu}}
data: {{train: {ws / 'sums.jsonl'}, seq_len: 32, validation_split: 0.0}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
task: {{type: grpo, num_generations: 2, max_new_tokens: 3, kl_beta: {beta}}}
reward: {{functions: [exact_answer], answer_field: completion}}
training: {{max_steps: 1, batch_size: 2}}
output: {{dir: {ws / f'grpo-{beta}'}}}
""")
        if beta:
            with pytest.raises(ConfigError, match=r"task\.kl_beta: the KL reference is the model with its adapters "
                                                  r"off"):
                train(load_recipe(path))
        else:
            train(load_recipe(path))
            assert (ws / f"grpo-{beta}" / "adapter" / "adapter_config.json").is_file()
