"""Preference training steps against TRL 1.16 with PEFT, on a tiny random Llama saved by transformers.

Both sides start from the same weights: the base folder, and one LoRA adapter (entrenar's, B randomised so every
factor gets a gradient) that PEFT loads. TRL's side is TRL's own loss code — ``DPOTrainer._compute_loss`` /
``KTOTrainer._compute_loss`` with its fused LM head on the PEFT model, the reference by PEFT's adapter switch —
called on a stand-in ``self`` with the attributes it reads (building the trainers needs a dataset pipeline that
would add nothing here); CPOTrainer's SimPO and ORPOTrainer's losses are their loss methods on the log-probabilities
of transformers' logits. Each side takes a few plain SGD steps on the same pairs, batch of 2 pairs, no shuffling;
the per-step loss, TRL's logged rewards and the final adapter weights agree within fp32 tolerance.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from conftest import nonzero_adapters
from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters, save_adapter
from entrenar.config import load_recipe
from entrenar.data.preference import PreferencePair, UnpairedExample, collate_preference
from entrenar.distributed.parallelize import Single
from entrenar.loading import load
from entrenar.tasks.preference import PreferenceTask

peft = pytest.importorskip("peft")
trl_utils = pytest.importorskip("trl.trainer.utils")
trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
trl_kto = pytest.importorskip("trl.trainer.kto_trainer")
trl_cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
trl_orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")

STEPS, LR, PAIRS_PER_BATCH, R = 3, 0.5, 2, 4
_ACCELERATOR = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t,
                               unwrap_model=lambda m: m)


def _pairs() -> list[PreferencePair]:
    g = torch.Generator().manual_seed(7)

    def ids(n):
        return torch.randint(3, 128, (n,), generator=g).tolist()

    # prompts and completions of several lengths
    return [PreferencePair(ids(3 + i % 3), ids(2 + i % 4), ids(4 - i % 3)) for i in range(STEPS * PAIRS_PER_BATCH)]


@pytest.fixture
def start(hf_folder, tmp_path):
    """(base folder, adapter folder): entrenar's LoRA on every linear layer, B drawn at random."""
    folder, _ = hf_folder("llama")
    model, _ = load(folder, dtype="float32", device="cpu")
    cfg = LoraConfig(r=R, alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"))
    apply_lora(model, cfg)
    nonzero_adapters(model, std=0.02, seed=1)
    save_adapter(model, tmp_path / "adapter", cfg, base_model_name_or_path=str(folder))
    return folder, tmp_path / "adapter"


def _entrenar(start, tmp_path, loss: str, examples, packing: bool, per_batch: int = PAIRS_PER_BATCH, **task):
    folder, adapter = start
    settings = ", ".join(f"{k}: {v}" for k, v in {"type": "preference", "loss": loss, **task}.items())
    (tmp_path / "r.yaml").write_text(f"""
model: {{path: {folder}, device: cpu}}
data: {{train: {tmp_path / 'unused.jsonl'}, seq_len: 32, packing: {str(packing).lower()}}}
lora: {{r: {R}, alpha: 8}}
task: {{{settings}}}
""")
    recipe = load_recipe(tmp_path / "r.yaml")
    model, _ = load(folder, adapter=adapter, dtype="float32", device="cpu")
    for p in lora_parameters(model):
        p.requires_grad_(True)
    model.train()
    preference = PreferenceTask(recipe)
    preference.prepare(model)
    optimizer = torch.optim.SGD(lora_parameters(model), lr=LR)
    steps = []
    for step in range(STEPS):
        batch = collate_preference(examples, range(step * per_batch, (step + 1) * per_batch), 32,
                                   packing=packing, kl=loss == "kto")
        value = preference.loss_sum(Single(model), batch) / preference.num_targets(batch)
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"loss": float(value.detach()), **{k: float(v) for k, v in preference.step_metrics().items()}})
    weights = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    return steps, weights


def _peft_model(start):
    import transformers

    folder, adapter = start
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trl_utils.add_fused_lm_head(base, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    model = peft.PeftModel.from_pretrained(base, adapter, is_trainable=True)
    model.train()
    return model


def _rows(sequences: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """TRL's layout: prompt + completion per row, right-padded, with the completion mask."""
    width = max(len(p) + len(c) for p, c in sequences)
    ids, attention, completion = (torch.zeros(len(sequences), width, dtype=torch.long) for _ in range(3))
    for i, (p, c) in enumerate(sequences):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        attention[i, :len(p) + len(c)] = 1
        completion[i, len(p):len(p) + len(c)] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _weights_of(model) -> dict[str, torch.Tensor]:
    """PEFT's adapter weights under entrenar's names."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            name = name.removeprefix("base_model.model.").replace(".default", "")
            out[name] = p.detach().clone()
    return out


def _trl_steps(model, compute) -> list[dict[str, float]]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    steps = []
    for step in range(STEPS):
        value, metrics = compute(step)
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append({"loss": float(value.detach()), **metrics})
    return steps


def _stand_in(model, **attributes):
    metrics = defaultdict(lambda: defaultdict(list))
    return SimpleNamespace(model=model, ref_model=None, accelerator=_ACCELERATOR, aux_loss_enabled=False,
                           args=SimpleNamespace(gradient_checkpointing_kwargs=None), _metrics=metrics,
                           _total_train_tokens=0, _tp_size=1, **attributes)


def _compare(ours, theirs, ours_weights, theirs_weights, keys):
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), step
        for key in keys:
            if key not in b:  # nothing to count in this batch (KTO without desirable examples): not logged
                assert a[key] != a[key], (step, key)  # NaN, left out of metrics.jsonl by the step
                continue
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (step, key)
    assert set(ours_weights) == set(theirs_weights)
    for name, value in ours_weights.items():
        torch.testing.assert_close(value, theirs_weights[name], rtol=1e-4, atol=1e-6, msg=name)


REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_dpo_and_ipo_steps_equal_trl_dpo_trainer_with_peft(start, tmp_path, loss, packing):
    pairs = _pairs()
    ours, ours_weights = _entrenar(start, tmp_path, loss, pairs, packing, beta=0.3)
    model = _peft_model(start)
    self = _stand_in(model, ld_alpha=None, precompute_ref_logps=False, f_divergence_type="reverse_kl",
                     loss_types=["sigmoid" if loss == "dpo" else "ipo"], loss_weights=[1.0], beta=0.3,
                     label_smoothing=0.0, use_weighting=False)

    def compute(step):
        batch = pairs[step * PAIRS_PER_BATCH:(step + 1) * PAIRS_PER_BATCH]
        inputs = _rows([(p.prompt, p.chosen) for p in batch] + [(p.prompt, p.rejected) for p in batch])
        value = trl_dpo.DPOTrainer._compute_loss(self, model, inputs, False)
        return value, {k: v[-1] for k, v in self._metrics["train"].items()}

    _compare(ours, _trl_steps(model, compute), ours_weights, _weights_of(model), REWARDS)


def _logps_of(model, sequences, average: bool) -> torch.Tensor:
    """TRL's CPO/ORPO ``get_batch_logps`` on transformers' logits (PEFT model, full logits)."""
    inputs = _rows(sequences)
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    return trl_cpo.CPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_simpo_and_orpo_steps_equal_trl_cpo_and_orpo_losses(start, tmp_path, loss):
    pairs = [PreferencePair(p.prompt, p.chosen[:2], p.rejected) for p in _pairs()]  # ORPO: equal chosen lengths
    ours, ours_weights = _entrenar(start, tmp_path, loss, pairs, True, beta=2.0 if loss == "simpo" else 0.2)
    model = _peft_model(start)

    def compute(step):
        batch = pairs[step * PAIRS_PER_BATCH:(step + 1) * PAIRS_PER_BATCH]
        logps = _logps_of(model, [(p.prompt, p.chosen) for p in batch] + [(p.prompt, p.rejected) for p in batch],
                          average=True)
        chosen, rejected = logps[:len(batch)], logps[len(batch):]
        if loss == "simpo":
            self = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.0,
                                   accelerator=_ACCELERATOR)
            losses, cr, rr = trl_cpo.CPOTrainer.cpo_loss(self, chosen, rejected)
            value = losses.mean()  # cpo_alpha = 0
        else:
            self = SimpleNamespace(beta=0.2, accelerator=_ACCELERATOR)
            losses, cr, rr, _, _ = trl_orpo.ORPOTrainer.odds_ratio_loss(self, chosen, rejected)
            sums = _logps_of(model, [(p.prompt, p.chosen) for p in batch], average=False)
            nll = -sums.sum() / sum(len(p.chosen) for p in batch)  # cross-entropy over the chosen tokens
            value = nll - losses.mean()
        return value, {"rewards/chosen": cr.mean().item(), "rewards/rejected": rr.mean().item(),
                       "rewards/accuracies": (cr > rr).float().mean().item(),
                       "rewards/margins": (cr - rr).mean().item(), "logps/chosen": chosen.mean().item(),
                       "logps/rejected": rejected.mean().item()}

    _compare(ours, _trl_steps(model, compute), ours_weights, _weights_of(model), REWARDS)


def test_kto_steps_equal_trl_kto_trainer_with_peft(start, tmp_path):
    # 3 a micro-batch, so the direction of the mismatch (prompt i with completion i-1) shows
    examples = [UnpairedExample(p.prompt, c, d) for p in _pairs()[:5] for c, d in ((p.chosen, True),
                                                                                 (p.rejected, False))]
    examples = [examples[i] for i in (0, 3, 2, 1, 4, 6, 5, 7, 9)]  # micro-batches of mixed kinds
    ours, ours_weights = _entrenar(start, tmp_path, "kto", examples, True, per_batch=3, beta=0.5,
                                   desirable_weight=1.5)
    model = _peft_model(start)
    self = _stand_in(model, precompute_ref_logps=False, calculate_KL=True, loss_type="kto", beta=0.5,
                     desirable_weight=1.5, undesirable_weight=1.0)
    self._compute_kl_logps = lambda m, batch: trl_kto.KTOTrainer._compute_kl_logps(self, m, batch)

    def compute(step):
        batch = examples[step * 3:(step + 1) * 3]
        inputs = _rows([(e.prompt, e.completion) for e in batch])
        cycled = [batch[-1].completion] + [e.completion for e in batch[:-1]]  # TRL's collator: completions +1
        kl = _rows([(e.prompt, c) for e, c in zip(batch, cycled, strict=True)])
        inputs |= {"KL_input_ids": kl["input_ids"], "KL_attention_mask": kl["attention_mask"],
                   "KL_completion_mask": kl["completion_mask"], "label": torch.tensor([e.desirable for e in batch])}
        self._metrics.clear()  # TRL leaves out a metric a batch has nothing for (then its last value stays)
        value = trl_kto.KTOTrainer._compute_loss(self, model, inputs, False)
        return value, {k: v[-1] for k, v in self._metrics["train"].items()}

    theirs = _trl_steps(model, compute)
    keys = ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
    _compare(ours, theirs, ours_weights, _weights_of(model), keys)
