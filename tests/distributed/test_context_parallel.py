"""Context parallelism on 2 gloo processes: one padding-free row split over both ranks (Ulysses all-to-all)
computes the loss and gradients of the whole row on one process, and a run trains as one process does, LoRA
under DDP and full fine-tuning under FSDP2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cp_workers import DOCUMENT_LENGTHS, grads_worker, split_train_worker  # noqa: E402
from dist_fixtures import shared  # noqa: E402, F401  (a fixture)
from test_data_parallel import assert_same_run  # noqa: E402
from workers import launch, train_worker  # noqa: E402

from entrenar.config import load_recipe  # noqa: E402
from entrenar.distributed.context_parallel import check_context_parallel, describe, kv_copies, shard_row  # noqa: E402
from entrenar.distributed.world import World  # noqa: E402
from entrenar.errors import ConfigError  # noqa: E402
from entrenar.models.config import ModelConfig  # noqa: E402
from entrenar.train.plan import plan_for  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             model_type="llama")


def test_a_row_split_over_two_ranks_has_the_loss_and_gradients_of_the_whole_row():
    """GQA (2 key/value heads, one a rank), one key/value head (copied to both ranks), a sliding window shorter
    than the documents, gpt-oss's sinks (each rank its heads'), Gemma 2's soft-capped scores, DeepSeek's latent
    attention (values narrower than queries), and recomputed layers; documents cross the slices' boundary and the
    row is padded."""
    assert sum(DOCUMENT_LENGTHS) % 2 == 1 and DOCUMENT_LENGTHS[0] < 13 < sum(DOCUMENT_LENGTHS[:2])
    configs = [LLAMA, {**LLAMA, "num_kv_heads": 1}, {**LLAMA, "sliding_window": 4},
               {**LLAMA, "attention_sinks": True}, {**LLAMA, "attn_logit_softcapping": 5.0},
               {**LLAMA, "num_kv_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "v_head_dim": 4, "head_dim": 4}]
    runs = [(options, False) for options in configs] + [(LLAMA, True)]
    for got in launch(grads_worker, runs)[0]:
        assert got["local_tokens"] == 13 and got["split_targets"] == got["targets"]
        assert got["split_loss"] == pytest.approx(got["loss"], rel=1e-6)
        assert got["one"].keys() == got["split"].keys()
        for name, expected in got["one"].items():
            torch.testing.assert_close(got["split"][name], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_a_slice_holds_its_tokens_and_the_next_slices_first_label():
    ids = torch.arange(5)[None]
    batch = {"input_ids": ids, "labels": ids + 10, "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
             "cu_seqlens": torch.tensor([0, 3, 5], dtype=torch.int32), "max_seqlen": 3, "step_targets": 7}
    first, second = shard_row(batch, 2, 0), shard_row(batch, 2, 1)
    assert first["input_ids"].tolist() == [[0, 1, 2]] and second["input_ids"].tolist() == [[3, 4, 0]]
    assert first["labels"].tolist() == [[10, 11, 12, 13]] and second["labels"].tolist() == [[13, 14, -100, -100]]
    assert second["position_ids"].tolist() == [[0, 1, 0]]  # the filler token: a document of its own
    assert second["cu_seqlens"].tolist() == [0, 3, 5, 6] and second["max_seqlen"] == 3
    assert first["step_targets"] == 7


def test_key_value_heads_are_copied_only_as_far_as_the_ranks_need():
    assert kv_copies(32, 8, 4) == 1 and kv_copies(4, 1, 2) == 2 and kv_copies(8, 2, 8) == 4
    assert kv_copies(6, 3, 2) == 2 and kv_copies(32, 8, 16) == 2
    with pytest.raises(ConfigError, match="3 key/value heads"):
        kv_copies(6, 3, 4)  # 6 query heads do not divide over 4 either (refused by name before: see below)


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_context_parallel_run_trains_as_one_process(shared, method):
    """2 ranks, each row split over both (one data-parallel group): the losses and the final adapter (LoRA,
    under DDP) or model (full fine-tuning, under FSDP2) of one process on the same padding-free rows."""
    ws, recipes, _ = shared
    flat = ["data.padding_free=true"]
    one, two = ws / f"cp-one-{method}", ws / f"cp-two-{method}"
    train_worker(recipes[method], [*flat, f"output.dir={one}"])
    parallel = "fsdp" if method == "full" else "ddp"
    results = launch(split_train_worker, recipes[method], [*flat, "training.context_parallel=2",
                                                           f"training.parallel={parallel}", f"output.dir={two}"])
    assert results[0][0] == results[1][0]
    # Both ranks read the same 8 micro-batches (4 steps x 2 accumulation) and each took half of every row.
    assert [n for n, _ in results[0][2]] == [n for n, _ in results[1][2]] and len(results[0][2]) == 8
    assert all(local == -(-n // 2) for n, local in results[0][2])
    assert_same_run(two, one, method)
    assert "identical on 2 ranks" in results[0][1]


def test_two_data_parallel_groups_of_two_ranks_train_as_one_process(shared):
    """4 processes as a 2 x 2 mesh: ranks 0-1 split one group's rows, ranks 2-3 the other's; the run is one
    process's (LoRA under DDP over all 4)."""
    ws, recipes, _ = shared
    flat = ["data.padding_free=true"]
    one, four = ws / "cp-one-dp", ws / "cp-four"
    train_worker(recipes["lora"], [*flat, f"output.dir={one}"])
    # Four processes on a 2-core CI machine: the last one can reach the store more than the recipes' 20 s after
    # the first (2026-11-27: "wait timeout after 20000ms, keys: .../device_type/2"), so this run waits longer.
    ranks = launch(split_train_worker, recipes["lora"], [*flat, "training.context_parallel=2",
                                                         "training.parallel=ddp", "training.dist_timeout_s=180",
                                                         f"output.dir={four}"], nproc=4)
    rows = {rank: [n for n, _ in result[2]] for rank, result in ranks.items()}
    assert rows[0] == rows[1] and rows[2] == rows[3] and rows[0] != rows[2] and len(rows[0]) == 4
    assert_same_run(four, one)


def test_the_plan_shows_context_parallelism_and_divides_the_activations(shared):
    ws, recipes, _ = shared
    long = ["data.seq_len=4096", "training.batch_size=1", "training.global_batch_size=null"]
    whole = plan_for(load_recipe(recipes["lora"], long), "cpu", processes=2)[0]
    split = plan_for(load_recipe(recipes["lora"], [*long, "training.context_parallel=2"]), "cpu", processes=2)[0]
    reasons = dict(split.reasons)
    assert "2 ranks per sequence" in reasons["training.context_parallel"]
    assert "training.context_parallel" not in dict(whole.reasons)
    assert split.memory.activations == pytest.approx(whole.memory.activations / 2, rel=0.05)
    assert split.rows_per_step == whole.rows_per_step // 2  # one data-parallel group reads one row
    # On GPUs, LoRA under ddp replays CUDA graphs of packed rows; split rows are padding-free: no graphs.
    gpu = [load_recipe(recipes["lora"], ["model.device=cuda", "data.padding_free=auto", *extra])
           for extra in ([], ["training.context_parallel=2"])]
    assert [plan_for(r, "cuda", processes=2)[0].cuda_graphs for r in gpu] == [True, False]


def test_the_start_line_counts_rows_by_data_parallel_group():
    line = describe("fsdp", World(rank=0, size=8, backend="nccl"), 4, 1, 2, 131072)
    assert line == ("fsdp on 8 processes (nccl), each row split over 4 of them: global batch 4 rows = 1 per group x 2 "
                    "accumulation x 2 data-parallel group(s) (up to 524,288 tokens a step, 32,768 a process)")


@pytest.mark.parametrize(("change", "message"), [
    ({"world": 3}, "does not divide the 3 process"),
    ({"num_heads": 6, "num_kv_heads": 6, "head_dim": 8, "cp": 4, "world": 4}, "6 attention heads do not divide over 4"),
    ({"task": "preference"}, "causal-LM rows only"),
    ({"padding_free": False}, "data.padding_free is false"),
    ({"num_experts": 4}, "MoE"),
    ({"compile": True}, "training.compile"),
    ({"cuda_graphs": True}, "training.cuda_graphs"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic RoPE scaling"),
])
def test_what_context_parallelism_cannot_split_is_refused_by_name(change, message):
    change = dict(change)
    world = World(rank=0, size=change.pop("world", 2), backend="gloo")
    cp, task = change.pop("cp", 2), change.pop("task", "causal_lm")
    padding_free, compile = change.pop("padding_free", "auto"), change.pop("compile", False)
    graphs = change.pop("cuda_graphs", False)
    config = ModelConfig(**{**LLAMA, **change})
    with pytest.raises(ConfigError, match=f"training.context_parallel: .*{message}"):
        check_context_parallel(cp, world, config, task, padding_free, moe=config.num_experts > 0, compile=compile,
                               cuda_graphs=graphs)
