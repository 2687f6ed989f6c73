"""Preference steps replayed from a CUDA graph (the fixed layout of entrenar.data.preference_static): captured on one
micro-batch and replayed on micro-batches of other shapes (fewer pairs than the capacity among them), the losses,
TRL metrics, gradients and trained adapters of the eager step, directly and through ``entrenar train``. GPU only:
on a CPU, tests/tasks/test_preference_static.py checks the layout against each batch's own."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_preference_static import _collate, _examples, _task

from conftest import make_hf_model, make_workspace, nonzero_adapters
from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.config import load_recipe
from entrenar.distributed.parallelize import Single
from entrenar.loading import load
from entrenar.train import cuda_graph
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics
from entrenar.train.stepping import MicroStep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")

CUDA = torch.device("cuda")
# one micro-batch a step; the graph is captured at the 4th call (3 eager warm-up calls) and replayed after, on
# batches of other lengths and, at the 6th and 9th, of fewer pairs than the capacity (4)
SCHEDULE = ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [2, 5, 9, 11], [1, 3, 5, 7], [8, 9], [0, 2, 4, 6],
            [3, 6, 10, 11], [10])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs") / "llama"
    make_hf_model("llama", vocab_size=96).save_pretrained(path)  # head size 16: the variable-length kernel's
    return path


def _cuda_model(folder):
    model, _ = load(folder, dtype="float32", device="cuda")
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    nonzero_adapters(model)
    return model


def _relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x, y = torch.cat([t.float().flatten() for t in a]), torch.cat([t.float().flatten() for t in b])
    return float((x - y).norm() / y.norm().clamp(min=1e-12))


@pytest.mark.parametrize("loss,share", [("dpo", "true"), ("dpo", "false"), ("orpo", "true"), ("kto", "false")])
def test_replayed_steps_equal_eager_steps_on_batches_of_other_shapes(tmp_path, folder, loss, share):
    examples = _examples(loss == "kto", n=12)
    graphed_model = _cuda_model(folder)
    eager_model = copy.deepcopy(graphed_model)
    runs = []
    for model, graphs in ((eager_model, False), (graphed_model, True)):
        task = _task(tmp_path, folder, loss, share, model, examples)
        trainable = [p for p in model.parameters() if p.requires_grad]
        step = MicroStep(task, Single(model), None, CUDA, "bf16", torch.amp.GradScaler("cuda", enabled=False),
                         trainable, graphs=graphs)
        optimizer = torch.optim.SGD(trainable, lr=0.1)
        optimizer.zero_grad(set_to_none=False)
        records = []
        for indices in SCHEDULE:
            batch = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v
                     for k, v in task.graph_layout(_collate(examples, indices, loss)).items()}
            batch["step_targets"] = torch.tensor(float(len(indices)), device=CUDA)
            value = step(batch)
            metrics = {k: v.detach().clone() for k, v in task.step_metrics().items()}
            records.append((value.clone(), metrics, [p.grad.clone() for p in trainable]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # in place: the graph adds into these tensors
        torch.cuda.synchronize()
        runs.append((records, [p.detach().clone() for p in trainable], step))
    (eager, eager_weights, _), (graphed, graphed_weights, step) = runs
    assert step.run.graph is not None and len(SCHEDULE) > cuda_graph.WARMUP_CALLS + 1  # replayed, not eager
    for i, ((le, me, ge), (lg, mg, gg)) in enumerate(zip(eager, graphed, strict=True)):
        assert torch.isfinite(lg), f"call {i}"
        torch.testing.assert_close(lg, le, rtol=2e-2, atol=2e-3, msg=f"loss of call {i}")
        assert set(mg) == set(me) and "rewards/chosen" in mg
        for key in me:
            torch.testing.assert_close(mg[key], me[key], rtol=2e-2, atol=2e-2, equal_nan=True,
                                       msg=f"{key} of call {i}")
        assert _relative(gg, ge) < 2e-2, f"gradients of call {i}"
    assert _relative(graphed_weights, eager_weights) < 1e-2
    # the replays saw each batch's data: its losses differ from call to call as the eager ones do
    assert len({round(float(r[0]), 5) for r in graphed[cuda_graph.WARMUP_CALLS:]}) > 3


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = make_workspace(tmp_path_factory.mktemp("pref-graphs"))
    with open(root / "pairs.jsonl", "w") as f:
        for a in range(24):  # prompts and completions of several lengths
            f.write(json.dumps({"prompt": f"{a}+{a % 7}=", "chosen": str(a + a % 7), "rejected": str(a * 3 + 1)})
                    + "\n")
    return root


def _recipe(ws, name, *overrides):
    path = ws / f"{name}.yaml"
    path.write_text(f"""
model: {{path: {ws / 'model'}, device: cuda}}
data: {{train: {ws / 'pairs.jsonl'}, seq_len: 32, validation_split: 0}}
lora: {{r: 4, alpha: 8, target_modules: all-linear, dropout: 0}}
task: {{type: preference}}
optimizer: {{lr: 5.0e-3}}
schedule: {{warmup_steps: 0}}
training: {{max_steps: 6, batch_size: 2, grad_accum: 2, eval_every: 0, log_every: 1, precision: bf16}}
output: {{dir: {ws / name}}}
""")
    return load_recipe(path, list(overrides))


@pytest.mark.parametrize("settings", [["task.loss=dpo", "task.share_prompt=true"], ["task.loss=kto"],
                                      ["task.share_prompt=true", "model.dtype=bfloat16", "lora.quantize_base=nf4",
                                       "training.activation_checkpointing=true", "training.offload_weights=true"]],
                         ids=["dpo-shared", "kto", "qlora-shared-streamed"])
def test_entrenar_train_with_graphs_gives_the_eager_losses_and_metrics(ws, settings, monkeypatch):
    """6 steps of 2 micro-batches through the Trainer (the graph captured at the 4th micro-step, replayed at the 8
    after): the losses and TRL metrics of the eager run, and a graph was captured. (Unshared pairs, ORPO and fewer
    pairs than the capacity: the test above.)"""
    captured = []
    capture = cuda_graph.GraphedMicroStep._capture

    def counting(self, inputs):
        captured.append(sorted(inputs))
        return capture(self, inputs)

    monkeypatch.setattr(cuda_graph.GraphedMicroStep, "_capture", counting)
    tag = "-".join(s.split("=")[-1] for s in settings)
    eager = train(_recipe(ws, f"e-{tag}", *settings, "training.cuda_graphs=false"), progress=False)
    assert not captured
    graphed = train(_recipe(ws, f"g-{tag}", *settings, "training.cuda_graphs=true"), progress=False)
    assert len(captured) == 1 and "pair_mask" in captured[0]

    def steps(run):
        return [r for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r]

    a, b = steps(eager), steps(graphed)
    assert len(a) == len(b) == 6
    torch.testing.assert_close(torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in a]),
                               atol=2e-2, rtol=0)
    assert [r["tokens"] for r in b] == [r["tokens"] for r in a]
    names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")
    for x, y in zip(a, b, strict=True):  # a KTO step without undesirable examples logs no rewards/rejected: neither
        assert {k for k in names if k in y} == {k for k in names if k in x} and any(k in y for k in names)
        for key in (k for k in names if k in x):
            torch.testing.assert_close(torch.tensor(y[key]), torch.tensor(x[key]), atol=5e-2, rtol=5e-2,
                                       msg=f"{key} at step {x['step']}")
