"""DDP with flat gradients (entrenar.distributed.flat_grads) on 2 gloo processes: the same adapters as one process
over the same global batch and as torch's DistributedDataParallel, gradient accumulation included, with one
all-reduce of the gradients per optimizer step; and a killed rank whose deterministic restart ends bit for bit
where an uninterrupted run does."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from dist_fixtures import shared  # noqa: E402, F401  (a fixture)
from test_data_parallel import assert_same_run, losses, weights  # noqa: E402
from workers import collective_worker, dying_worker, launch, reduction_worker, train_worker  # noqa: E402

import entrenar.train.plan as plan_module  # noqa: E402
from entrenar.distributed.flat_grads import CARRY_SLOTS  # noqa: E402
from entrenar.train.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# 8 rows a step: 4 micro-batches on one process, 2 on each of two (accumulation on both).
ACCUMULATING = ["training.global_batch_size=8", "training.max_steps=3"]


@pytest.fixture(scope="module")
def accumulating(shared):
    """The one-process reference run of 3 steps of 8 rows."""
    ws, recipes, _ = shared
    one = ws / "one-accumulating"
    if not (one / "adapter").is_dir():
        train_worker(recipes["lora"], [*ACCUMULATING, f"output.dir={one}"])
    return one


@pytest.mark.parametrize("extra", [[], ["optimizer.fused=true", "training.overlap_steps=true"]],
                         ids=["sync", "overlapped"])
def test_flat_gradients_train_as_one_process_with_one_all_reduce_a_step(shared, accumulating, extra):
    ws, recipes, _ = shared
    run = ws / f"flat-{len(extra)}"
    results = launch(reduction_worker, recipes["lora"], [*ACCUMULATING, *extra, f"output.dir={run}"])
    kind, summary, sizes, _ = results[0]
    assert kind == "FlatReplicated"
    assert "identical on 2 ranks at 3 check(s)" in summary  # replica_check_every: 1
    if not extra:
        assert_same_run(run, accumulating)
    else:  # the fused optimizer rounds differently from the reference's foreach one
        # every line has each rank's peak memory (carried by its step's all-reduce, read with its loss)
        assert [len(r["peak_mem_gb_ranks"]) for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [2] * 3
        for name, tensor in weights(accumulating, "lora").items():
            torch.testing.assert_close(weights(run, "lora")[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    trainable = sum(t.numel() for t in load_file(run / "adapter" / "adapter_model.safetensors").values())
    flat = trainable + CARRY_SLOTS + 2  # the gradients, then the step's loss and peaks (2 ranks) in spare slots
    for rank_sizes in (sizes, results[1][2]):
        assert rank_sizes.count(flat) == 3  # one all-reduce of every gradient per optimizer step
        assert all(n == flat or n < 16 for n in rank_sizes)  # and none per parameter (the rest: token counts)


def test_flat_gradients_match_torch_ddp_which_large_gradients_keep(shared, accumulating, monkeypatch):
    ws, recipes, _ = shared
    run = ws / "torch-ddp"
    # Gradients above the bound go to torch's DistributedDataParallel (forked workers inherit the bound).
    monkeypatch.setattr(plan_module, "FLAT_GRADIENTS_MAX_BYTES", 0)
    results = launch(reduction_worker, recipes["lora"], [*ACCUMULATING, f"output.dir={run}"])
    kind, _, sizes, _ = results[0]
    assert kind == "Replicated"
    trainable = sum(t.numel() for t in weights(run, "lora").values())
    assert trainable not in sizes  # DDP's reducer all-reduces its buckets in C++
    assert_same_run(run, accumulating)
    flat = ws / "flat-0"
    if (flat / "adapter").is_dir():  # the flat run of the test above
        for name, tensor in weights(flat, "lora").items():
            torch.testing.assert_close(weights(run, "lora")[name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def test_a_killed_rank_restarts_deterministically_to_the_bits_of_an_uninterrupted_run(shared):
    ws, recipes, _ = shared
    common = [*ACCUMULATING, "training.max_steps=5", "training.save_every=2", "training.deterministic=true"]
    clean, restarted = ws / "deterministic-clean", ws / "deterministic-restarted"
    launch(train_worker, recipes["lora"], [*common, f"output.dir={clean}"])
    # rank 1 dies hard after logging step 3; the job restarts from step 2's checkpoint.
    launch(dying_worker, recipes["lora"], [*common, f"output.dir={restarted}"], 3, max_restarts=1)
    assert losses(restarted) == losses(clean) and len(losses(clean)) == 5
    got, expected = weights(restarted, "lora"), weights(clean, "lora")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(shared, monkeypatch):
    """Rank 1's gradients of step 2 turn NaN (its loss stays finite): the flat all-reduce carries the NaN to rank
    0, both ranks read the same norm, drop the same update (training.nonfinite: skip) and stay replicas."""
    import os

    import entrenar
    from entrenar.tasks import causal_lm

    real_load, calls = entrenar.load, [0]

    def load(*args, **kwargs):
        model, tokenizer = real_load(*args, **kwargs)

        def hook(module, inputs, output):
            if output.requires_grad and os.environ.get("RANK") == "1":
                calls[0] += 1
                if calls[0] == 3:  # step 2's first micro-batch (2 a step on each rank)
                    output.register_hook(lambda grad: grad * float("nan"))

        model.model.norm.register_forward_hook(hook)
        return model, tokenizer

    monkeypatch.setattr(causal_lm, "load", load)  # the forked workers inherit it
    ws, recipes, _ = shared
    run = ws / "flat-nan"
    results = launch(reduction_worker, recipes["lora"], [*ACCUMULATING, "training.nonfinite=skip",
                                                          f"output.dir={run}"])
    assert results[0][0] == "FlatReplicated"
    assert "identical on 2 ranks at 3 check(s)" in results[0][1]
    skipped = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r.get("skipped")]
    assert skipped == [2]
    assert all(torch.isfinite(t).all() for t in weights(run, "lora").values())


def test_gradients_stay_views_of_one_flat_buffer_per_dtype_whatever_sets_them():
    """zero_grad(set_to_none=True) and a gradient that is its own tensor both end as views of the same buffer,
    which backward then adds into (a captured graph's addresses stay valid)."""
    from entrenar.distributed.flat_grads import FlatGradients

    a, b = torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))
    c = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    grads = FlatGradients([a, b, c])
    [flat32, flat64] = grads.buffers
    assert (flat32.numel(), flat64.numel()) == (10, 3)
    (a.sum() * 2 + b.sum() * 3 + c.sum()).backward()
    assert flat32.tolist() == [2.0] * 6 + [3.0] * 4 and flat64.tolist() == [1.0] * 3
    torch.optim.SGD([a, b, c]).zero_grad(set_to_none=True)
    b.grad = torch.full((4,), 5.0)
    grads.attach()
    assert flat32.tolist() == [0.0] * 6 + [5.0] * 4 and flat64.tolist() == [0.0] * 3
    assert a.grad.data_ptr() == flat32.data_ptr() and c.grad.data_ptr() == flat64.data_ptr()
    a.sum().backward()
    assert flat32.tolist() == [1.0] * 6 + [5.0] * 4


@pytest.mark.parametrize("extra", [[], ["optimizer.fused=true", "training.overlap_steps=true"], ["torch-ddp"]],
                         ids=["sync", "overlapped", "torch-ddp"])
def test_a_step_communicates_its_token_counts_and_its_gradients_and_nothing_else(shared, extra, monkeypatch):
    """Every torch.distributed collective of a LoRA run on 2 ranks, step by step (log_every 2,
    replica_check_every 3). Each step all-reduces its token counts (the loss divisor, before the forward) and its
    gradients, whose flat buffer carries the step's loss and each rank's peak memory: no all-reduce of the loss,
    none of a non-finite flag, no gather of the peaks on logged lines, no barrier. The replica check adds its one
    all-gather of byte sums (on the device) after the first step and every third step only, and at the first one
    object all-gather of the tensors' names and shapes. Under torch's DDP (whose reducer all-reduces the buckets in
    C++) the loss and peaks take one all-reduce of their own. The lines logged carry every rank's peak, and the
    summary (gathered once, at the end) the replica check's result and each rank's peak."""
    ws, recipes, reference = shared
    options = ["training.log_every=2", "training.replica_check_every=3", f"output.dir={ws / f'steps-{len(extra)}'}"]
    if extra == ["torch-ddp"]:
        monkeypatch.setattr(plan_module, "FLAT_GRADIENTS_MAX_BYTES", 0)  # forked workers inherit the bound
    else:
        options += extra
    results = launch(collective_worker, recipes["lora"], options)
    run = ws / f"steps-{len(extra)}"
    assert results[0]["kind"] == ("Replicated" if extra == ["torch-ddp"] else "FlatReplicated")
    trainable = sum(t.numel() for t in weights(run, "lora").values())
    for rank in (0, 1):
        calls = results[rank]["calls"]
        for step in (1, 2, 3):  # the last step (4) also evaluates, saves and summarises
            names, sizes = [name for name, _ in calls[step]], [n for _, n in calls[step]]
            # the first step's check also compares the layout (once); then every third step's sums
            replica = {1: ["all_gather_object", "all_gather"], 3: ["all_gather"]}.get(step, [])
            assert names == ["all_reduce", "all_reduce", *replica], (rank, step, calls[step])
            assert sizes[0] == 2  # targets and tokens
            if extra == ["torch-ddp"]:
                assert sizes[1] == 1 + 2  # the loss and 2 ranks' peaks
            else:
                assert trainable < sizes[1] <= trainable + CARRY_SLOTS + 2  # the gradients and what rides them
        assert [n for n, _ in calls[4]].count("all_gather") == 2  # the check's sums; the summary's peaks, once
    lines = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [len(r.get("peak_mem_gb_ranks", [])) for r in lines] == [0, 2, 0, 2]  # on the logged lines
    assert all(gb > 0 for r in lines for gb in r.get("peak_mem_gb_ranks", []))
    summary = results[0]["summary"]
    assert "identical on 2 ranks at 3 check(s), steps 1-4" in summary
    assert re.search(r"peak memory +rank 0 \d+\.\d\d GB, rank 1 \d+\.\d\d GB", summary)
    if "training.overlap_steps=true" in extra:  # the fused optimizer rounds differently from the reference's
        assert losses(run) == pytest.approx(losses(reference["lora"]), abs=1e-4)
    else:
        assert_same_run(run, reference["lora"])


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_nonfinite_loss_on_one_rank_reaches_every_rank_in_the_gradients_all_reduce(shared, monkeypatch, policy):
    """Rank 1's loss of step 2 turns inf while its gradients stay finite (a constant added): the loss that rides the
    flat all-reduce brings it to rank 0, so both ranks drop the same update (skip: still replicas) or both stop
    naming the step (stop), with no collective of its own for the decision."""
    import os

    from entrenar.errors import DistributedError
    from entrenar.tasks.causal_lm import CausalLMTask

    real_loss_sum, calls = CausalLMTask.loss_sum, [0]

    def loss_sum(self, model, batch):
        loss = real_loss_sum(self, model, batch)
        if os.environ.get("RANK") == "1" and torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == 3:  # step 2's first micro-batch (2 a step on each rank)
                return loss + float("inf")
        return loss

    monkeypatch.setattr(CausalLMTask, "loss_sum", loss_sum)  # the forked workers inherit it
    ws, recipes, _ = shared
    run = ws / f"flat-inf-loss-{policy}"
    options = [*ACCUMULATING, f"training.nonfinite={policy}", f"output.dir={run}"]
    if policy == "stop":
        with pytest.raises(DistributedError, match=r"step 2: non-finite loss \(inf\)"):
            launch(train_worker, recipes["lora"], options)
        return
    launch(train_worker, recipes["lora"], options)  # replica_check_every: 1 would stop a rank that applied it
    skipped = [(r["step"], r["skipped"]) for r in read_metrics(run / "metrics.jsonl") if r.get("skipped")]
    assert skipped == [(2, "non-finite loss (inf)")]


def test_a_group_of_one_issues_no_collective(shared):
    """`parallel: ddp` on one process (a process group of one: the N = 1 point of a scaling run) sums over one rank:
    no step issues a collective (token counts, gradients, loss), nor does the replica check, whose summary still
    says the one replica agrees; the adapters are the plain process's."""
    ws, recipes, reference = shared
    run = ws / "group-of-one"
    results = launch(collective_worker, recipes["lora"], ["training.parallel=ddp", "training.global_batch_size=4",
                                                          f"output.dir={run}"], nproc=1)
    assert results[0]["kind"] == "FlatReplicated"
    assert results[0]["calls"] == {}  # nothing, from the broadcast of the adapters to the summary's peaks
    assert "identical on 1 ranks at 4 check(s), steps 1-4" in results[0]["summary"]
    assert_same_run(run, reference["lora"])
