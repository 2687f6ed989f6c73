"""FSDP2 (fully_shard per decoder block) on gloo processes: the same optimisation as one process, and sharded
checkpoints (torch.distributed.checkpoint, each rank writing its shards) that resume on another world size
exactly: 2 -> 1 (a plain process) and 1 -> 2 (FSDP on one process, then on two)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_fixtures import shared  # noqa: E402, F401  (a fixture)
from test_data_parallel import assert_same_run, weights  # noqa: E402
from workers import launch, train_worker  # noqa: E402

import entrenar  # noqa: E402
from entrenar.adapters.lora import PEFT_PREFIX  # noqa: E402
from entrenar.train.checkpoint import is_sharded, latest_checkpoint  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def shard_files(run: Path) -> list[str]:
    """The shard files of a run's latest checkpoint (or of a checkpoint folder), checked to be sharded."""
    ckpt = run if run.parent.name == "checkpoints" else latest_checkpoint(run)
    assert ckpt is not None and is_sharded(ckpt) and not (ckpt / "model.safetensors").exists()
    return sorted(p.name for p in (ckpt / "shards").iterdir() if p.suffix == ".distcp")


@pytest.mark.parametrize("method", ["full", "lora"])
def test_sharded_checkpoints_resume_on_another_world_size_as_an_uninterrupted_run(shared, method):
    ws, recipes, reference = shared
    recipe, one = recipes[method], reference[method]
    run = ws / f"sharded-{method}"  # 2 steps, the checkpoint at step 2, then 2 more on the other world size
    first = ["training.parallel=fsdp", "training.max_steps=2", f"output.dir={run}"]
    if method == "full":  # 2 -> 1: two ranks' shards, read whole by one plain process
        launch(train_worker, recipe, first)
        assert shard_files(run) == ["__0_0.distcp", "__1_0.distcp"]
        step2 = latest_checkpoint(run)
        train_worker(recipe, [f"output.dir={run}", "training.max_steps=4"], True)
        entrenar.load(step2)  # a sharded full fine-tune's checkpoint loads whole: every weight, names checked
    else:  # 1 -> 2: one rank's shards (FSDP on one process), resharded over two
        launch(train_worker, recipe, first, nproc=1)
        assert shard_files(run) == ["__0_0.distcp"]
        launch(train_worker, recipe, [f"output.dir={run}", "training.parallel=fsdp", "training.max_steps=4"], True)
        assert shard_files(run) == ["__0_0.distcp", "__1_0.distcp"]
    assert_same_run(run, one, method)  # the final model / adapter: one plain file, as one process writes it
    # The last checkpoint loads as a model in one process (the shards joined): its weights are the output's.
    ckpt = run / "checkpoints" / "step-4"  # written by the 2 FSDP ranks (lora), or the plain process (full)
    assert is_sharded(ckpt) == (method == "lora")
    loaded = entrenar.load(ckpt)[0].state_dict()
    final = weights(run, method)
    assert len(final) > 0
    for name, tensor in final.items():
        torch.testing.assert_close(loaded[name.removeprefix(PEFT_PREFIX)], tensor, rtol=0, atol=0, msg=name)


def test_a_qlora_base_is_sharded_and_trains_as_on_one_process_resuming_across_world_sizes(shared):
    """QLoRA under FSDP: each rank keeps half of every NF4 layer's codes (gathered, they are a plain load's);
    2 ranks -> 1 plain process gives the losses and adapter of one uninterrupted process."""
    from workers import sharded_load_worker

    from entrenar import tasks
    from entrenar.config import load_recipe
    from entrenar.train.prepare import build_model

    ws, recipes, _ = shared
    recipe, nf4 = recipes["lora"], ["lora.quantize_base=nf4"]
    ranks = launch(sharded_load_worker, recipe, nf4, "nf4")
    r = load_recipe(recipe, nf4)
    plain = build_model(r, tasks.for_recipe(r), "float32", torch.device("cpu"), "nf4")[0]
    codes = {name: m.weight_codes for name, m in plain.named_modules() if hasattr(m, "weight_codes")}
    assert codes and ranks[0]["nf4"].keys() == ranks[1]["nf4"].keys() == codes.keys()
    for name, whole in codes.items():
        for rank in (0, 1):
            local, gathered = ranks[rank]["nf4"][name]
            assert local == -(-whole.numel() // 2)  # half of the codes on each rank
            assert torch.equal(gathered, whole), name

    one = ws / "qlora-one"
    train_worker(recipe, [*nf4, f"output.dir={one}"])
    two_one = ws / "qlora-2-1"  # 2 sharded ranks, then one plain process (the base quantized again from the files)
    launch(train_worker, recipe, [*nf4, "training.parallel=fsdp", "training.max_steps=2", f"output.dir={two_one}"])
    train_worker(recipe, [*nf4, f"output.dir={two_one}", "training.max_steps=4"], True)
    assert shard_files(two_one / "checkpoints" / "step-2") == ["__0_0.distcp", "__1_0.distcp"]
    assert_same_run(two_one, one)


def test_a_folder_saved_in_nf4_trains_sharded_as_on_one_process(shared):
    """A model folder already quantized to NF4 (`entrenar quantize`'s layout; how a base too large for a bf16
    folder is kept): the other ranks build it from the file headers alone (no data read, nothing to check), rank 0
    reads it, FSDP shards its codes; 2 ranks give the losses and adapter of one process on the same folder."""
    from entrenar.quant.checkpoint import load_quantized, save_quantized
    from entrenar.quant.nf4.format import quantize_model_nf4

    ws, recipes, _ = shared
    folder = ws / "model-nf4"
    if not folder.exists():
        model, tokenizer = entrenar.load(ws / "model")
        quantize_model_nf4(model, "all-linear")
        save_quantized(model, tokenizer, folder)
    skeleton = load_quantized(folder, device="meta")  # what a rank of the sharded load builds: no error
    assert {b.device.type for b in skeleton.buffers()} == {"meta"}

    nf4 = [f"model.path={folder}"]
    one, two = ws / "nf4-folder-one", ws / "nf4-folder-two"
    train_worker(recipes["lora"], [*nf4, f"output.dir={one}"])
    launch(train_worker, recipes["lora"], [*nf4, "training.parallel=fsdp", f"output.dir={two}"])
    assert_same_run(two, one)
