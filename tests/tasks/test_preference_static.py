"""Preference micro-batches in the fixed layout CUDA graphs replay (entrenar.data.preference_static): every batch the
same shapes and host numbers, every index in range, and the same loss, TRL metrics and gradients as the batch's own
padding-free layout, for each loss, shared and unshared prompts, and a micro-batch with fewer pairs than the
capacity. On the CPU: the layout and the task's masked path are plain PyTorch."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from conftest import make_hf_model, nonzero_adapters
from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.config import load_recipe
from entrenar.data import padding_free
from entrenar.data.preference import PreferencePair, UnpairedExample, collate_preference
from entrenar.data.preference_static import static_capacity, static_preference_batch
from entrenar.distributed.parallelize import Single
from entrenar.loading import load
from entrenar.tasks.preference import PreferenceTask
from entrenar.train.cuda_graph import GraphedMicroStep
from entrenar.train.stepping import MicroStep

SEQ_LEN = 32
BATCH = 4
# three micro-batches of different shapes: 4 pairs, 4 other pairs, and 2 (fewer than the capacity)
MICRO_BATCHES = ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9])


def _examples(unpaired: bool, n: int = 10, seed: int = 3, vocab: int = 96) -> list:
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(3, vocab, (k,), generator=g).tolist()

    if unpaired:
        return [UnpairedExample(ids(3 + i % 4), ids(2 + i % 5), desirable=i % 3 != 1) for i in range(n)]
    return [PreferencePair(ids(3 + i % 4), ids(2 + i % 5), ids(4 + i % 3)) for i in range(n)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("static") / "llama"
    make_hf_model("llama", vocab_size=96).save_pretrained(path)
    return path


def _model(folder):
    model, _ = load(folder, dtype="float32", device="cpu")
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    nonzero_adapters(model)
    return model


def _task(tmp_path, folder, loss, share, model, examples):
    (tmp_path / "r.yaml").write_text(f"""
model: {{path: {folder}, device: cpu}}
data: {{train: {tmp_path / 'unused.jsonl'}, seq_len: {SEQ_LEN}}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
task: {{type: preference, loss: {loss}, share_prompt: {share}}}
training: {{batch_size: {BATCH}}}
""")
    task = PreferenceTask(load_recipe(tmp_path / "r.yaml", []))
    task.prepare(model)
    task.stream(examples, types.SimpleNamespace(pad_id=0))
    return task


def _collate(examples, indices, loss):
    return collate_preference(examples, indices, SEQ_LEN, kl=loss == "kto", share_prompt=loss != "kto")


CASES = [("dpo", "auto"), ("dpo", "false"), ("ipo", "auto"), ("simpo", "false"), ("orpo", "auto"),
         ("orpo", "false"), ("kto", "false")]


@pytest.mark.parametrize("loss,share", CASES)
def test_fixed_layout_gives_the_loss_metrics_and_gradients_of_the_batch_own_layout(tmp_path, folder, loss, share):
    """One optimizer step over three micro-batches of different shapes (the last with 2 pairs of a capacity of
    4): the eager step on each batch's padding-free layout (today's), against the micro-step on the fixed layout
    (metrics handed back beside the loss, as a replayed graph hands them back)."""
    examples = _examples(loss == "kto")
    model = _model(folder)
    trainable = [p for p in model.parameters() if p.requires_grad]
    targets = torch.tensor(float(sum(len(i) for i in MICRO_BATCHES)))
    runs = []
    for fixed in (False, True):
        task = _task(tmp_path, folder, loss, share, model, examples)
        step = MicroStep(task, Single(model), None, torch.device("cpu"), "fp32",
                         torch.amp.GradScaler("cpu", enabled=False), trainable, graphs=False)
        model.zero_grad()
        total = torch.zeros(())
        for indices in MICRO_BATCHES:
            batch = _collate(examples, indices, loss)
            laid = task.graph_layout(batch) if fixed else padding_free(batch)
            if fixed:
                assert "pair_mask" in laid and task._shared(laid) == (share == "auto")
            total += step({**laid, "step_targets": targets})
        runs.append((total, task.step_metrics(), [p.grad.clone() for p in trainable], (task._counted,
                                                                                        task._computed)))
    (la, ma, ga, ca), (lb, mb, gb, cb) = runs
    torch.testing.assert_close(lb, la, rtol=1e-6, atol=1e-7)
    assert set(mb) == set(ma) and len(ma) >= 6
    for key in ma:
        torch.testing.assert_close(mb[key], ma[key], rtol=1e-6, atol=1e-6, equal_nan=True, msg=key)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in gb)
    assert cb == ca  # the tokens the summary reports, counted on the host as the batches are laid out


@pytest.mark.parametrize("kind", ["shared", "unshared", "kto"])
def test_every_batch_has_one_layout_and_indices_in_range(kind):
    """What a captured graph needs to replay any batch: the same keys, tensor shapes and dtypes, the same Python
    numbers; and every index it gathers with inside its tensors (the device-side assert an out-of-range one
    raises), segments that add up to the row and the keys."""
    examples = _examples(kind == "kto")
    capacity = static_capacity(examples, BATCH, SEQ_LEN, kl=kind == "kto")
    layouts = []
    for indices in (*MICRO_BATCHES, [9], [5, 3, 7, 0]):
        batch = collate_preference(examples, indices, SEQ_LEN, kl=kind == "kto", share_prompt=kind == "shared")
        out = static_preference_batch(batch, capacity, shared=kind == "shared")
        layouts.append(out)
        assert out["pair_mask"].tolist() == [1.0] * len(indices) + [0.0] * (BATCH - len(indices))
        n = out["num_sequences"]
        if kind == "shared":
            t, k = len(out["shared_input_ids"]), len(out["shared_kv_index"])
            assert out["shared_kv_index"].min() >= 0 and out["shared_kv_index"].max() < t
            assert out["shared_sources"].min() >= 0 and out["shared_sources"].max() < t
            assert out["shared_owners"].min() >= 0 and out["shared_owners"].max() <= n
            cu, cu_k = out["shared_cu_seqlens"], out["shared_cu_seqlens_k"]
            assert (cu[0], cu[-1], cu_k[0], cu_k[-1]) == (0, t, 0, k) and len(cu) == len(cu_k) == n + 2
            q_len, k_len = cu[1:] - cu[:-1], cu_k[1:] - cu_k[:-1]
            assert bool((q_len >= 0).all()) and bool((k_len >= q_len).all())  # every query sees a key
            assert int(q_len[-1]) >= 1  # the padding segment is never empty
            assert q_len.max() <= out["shared_max_seqlen"] and k_len.max() <= out["shared_max_seqlen_k"]
        else:
            cu = out["cu_seqlens"]
            t = out["input_ids"].shape[-1]
            assert (cu[0], cu[-1], len(cu)) == (0, t, n + 2) and bool((cu[1:] >= cu[:-1]).all())
            assert out["sequence_ids"].max() < n and out["max_seqlen"] == t
            real = out["sequence_ids"][out["sequence_ids"] >= 0]
            if kind == "kto":  # the KL sequences follow the capacity's examples
                assert set(real.tolist()) == set(range(len(indices))) | set(range(BATCH, BATCH + len(indices)))
    step = GraphedMicroStep(lambda inputs: torch.zeros(()), [])
    step.inputs = layouts[0]
    assert all(step._same_layout(out) for out in layouts[1:])


def test_a_padded_pair_changes_nothing_even_where_a_real_one_is_extreme(tmp_path, folder):
    """ORPO's log-odds are -inf at log-probability 0 (an empty sequence): a padded pair must stay out of the loss
    and its gradient (NaN times a zero weight is NaN)."""
    examples = _examples(False)
    model = _model(folder)
    task = _task(tmp_path, folder, "orpo", "auto", model, examples)
    laid = task.graph_layout(_collate(examples, [8], "orpo"))
    value = task.loss_sum(Single(model), laid)
    value.backward()
    assert torch.isfinite(value)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    stats = task.micro_stats()
    assert stats is not None and torch.isfinite(stats).all() and task.micro_stats() is None


def test_copy_of_model_untouched(folder):
    """The fixed layout's padding tokens attend only themselves: the real tokens' hidden states are the padding-free
    row's (the model itself, no task in between)."""
    model = _model(folder).eval()
    examples = _examples(False)
    batch = collate_preference(examples, [1, 2], SEQ_LEN, share_prompt=True)
    flat = padding_free(batch)
    out = static_preference_batch(batch, static_capacity(examples, BATCH, SEQ_LEN), shared=False)
    with torch.no_grad():
        a = model.hidden_states(flat["input_ids"], flat["position_ids"], None, cu_seqlens=flat["cu_seqlens"],
                                max_seqlen=flat["max_seqlen"])
        b = copy.deepcopy(model).hidden_states(out["input_ids"], out["position_ids"], None,
                                               cu_seqlens=out["cu_seqlens"], max_seqlen=out["max_seqlen"])
    torch.testing.assert_close(b[:, :a.shape[1]], a, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(b).all()


@pytest.mark.parametrize("loss,share", [("dpo", "auto"), ("kto", "false")])
def test_the_trainer_lays_batches_out_fixed_under_graphs_and_trains_as_without(tmp_path, loss, share, monkeypatch):
    """Through ``train``: with graphs on (here a stand-in that calls the step eagerly, as a CPU has no graphs) the
    Trainer hands the task's fixed layout to the micro-step; 4 steps of 2 micro-batches give the losses and TRL
    metrics of the run on each batch's own layout."""
    import json

    from conftest import make_workspace
    from entrenar.train import plan as plan_module
    from entrenar.train import stepping
    from entrenar.train.loop import train
    from entrenar.train.metrics import read_metrics

    ws = make_workspace(tmp_path)  # a tiny Llama with the quickstart's tokenizer
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for a in range(12):  # prompts and completions of several lengths
            f.write(json.dumps({"prompt": f"{a}+{a % 7}=", "chosen": str(a + a % 7), "rejected": str(a * 3 + 1)})
                    + "\n")
    seen: list[list[str]] = []

    class EagerStandIn:  # GraphedMicroStep's interface, calling the step eagerly
        eager_why = None

        def __init__(self, fn, params, capturable=None, strict=True):
            self.fn = fn

        def __call__(self, inputs):
            seen.append(sorted(inputs))
            return self.fn(inputs)

    def recipe(name, *overrides):
        (tmp_path / f"{name}.yaml").write_text(f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {tmp_path / 'pairs.jsonl'}, seq_len: {SEQ_LEN}, validation_split: 0}}
lora: {{r: 4, alpha: 8, target_modules: all-linear, dropout: 0}}
task: {{type: preference, loss: {loss}, share_prompt: {share}}}
optimizer: {{lr: 1.0e-2}}
schedule: {{warmup_steps: 0}}
training: {{max_steps: 4, batch_size: 3, grad_accum: 2, eval_every: 0, log_every: 1}}
output: {{dir: {tmp_path / name}}}
""")
        return load_recipe(tmp_path / f"{name}.yaml", list(overrides))

    dynamic = train(recipe("dynamic"), progress=False)
    assert not seen
    monkeypatch.setattr(plan_module.RunPlan, "graphs", lambda self, moe_replays: True)
    monkeypatch.setattr(stepping, "GraphedMicroStep", EagerStandIn)
    fixed = train(recipe("fixed"), progress=False)
    assert len(seen) == 8 and all("pair_mask" in keys for keys in seen)
    a, b = ([r for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r] for run in (dynamic, fixed))
    assert len(a) == len(b) == 4
    for x, y in zip(a, b, strict=True):
        assert {k for k in x if "/" in k} == {k for k in y if "/" in k} and x["tokens"] == y["tokens"]
        for key in [k for k in x if "/" in k or k in ("loss", "kl", "grad_norm")]:
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), key
