"""A full fine-tune under FSDP from a Hugging Face folder: every rank builds the model on the meta device and reads
its own shards from the safetensors files; the shards, the training and the checkpoints are those of the general
path (rank 0 reads the whole model and broadcasts it), bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from dist_fixtures import write_recipe  # noqa: E402
from workers import general_path_train_worker, launch, shard_read_worker, train_worker  # noqa: E402

from entrenar import quickstart  # noqa: E402
from entrenar.config import load_recipe  # noqa: E402
from entrenar.distributed.launch import launch_function  # noqa: E402
from entrenar.distributed.world import World  # noqa: E402
from entrenar.loading import recipe_model_config  # noqa: E402
from entrenar.models.config import ModelConfig  # noqa: E402
from entrenar.models.hf import save_hf  # noqa: E402
from entrenar.models.transformer import Transformer  # noqa: E402
from entrenar.train.plan import plan_run  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def bf16_folder(ws: Path, tie: bool = False, small: bool = False) -> int:
    """A bf16 model folder in several safetensors files (an odd vocabulary: shards of unequal rows); its size in
    fp32 bytes. Replaces the workspace's model. 76 MB in fp32 (enough for a whole copy to show in a process's
    peak memory), or 0.3 MB (``small``)."""
    tokenizer = quickstart.build_tokenizer()
    width = dict(hidden_size=48, intermediate_size=136, num_layers=3, num_heads=4) if small else \
        dict(hidden_size=528, intermediate_size=1544, num_layers=6, num_heads=8)
    config = ModelConfig(vocab_size=tokenizer.vocab_size + 1, **width, num_kv_heads=2, model_type="llama",
                         tie_word_embeddings=tie)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    model.reset_parameters()
    with torch.no_grad():
        for p in model.parameters():  # values whose bf16 -> fp32 widening is visible (norms not all ones)
            p.add_(torch.randn_like(p) * 0.01)
    save_hf(model, ws / "model", max_shard_bytes=150_000 if small else 8_000_000)
    tokenizer.save(ws / "model")
    return sum(p.numel() * 4 for p in model.parameters())


def test_every_rank_reads_its_own_shards_bitwise_as_rank_0s_broadcast_gives_them(tmp_path):
    from conftest import make_workspace

    ws = make_workspace(tmp_path)
    model_bytes = bf16_folder(ws)
    assert len(list((ws / "model").glob("*.safetensors"))) > 2
    recipe = write_recipe(ws, "full")
    # Spawned, as torchrun starts workers: a forked child's resident memory counts pages it shares with the parent.
    results = launch_function(shard_read_worker, (recipe, ["training.parallel=fsdp"]), start_method="spawn",
                              shutdown_timeout=2, nproc_per_node=2)
    for rank in (0, 1):
        r = results[rank]
        assert r["reason"] == "every rank reads its own shards from the files"
        assert r["files"]["built_on"] == "meta"
        assert r["general"]["built_on"] == ("cpu" if rank == 0 else "meta")
        assert r["names_equal"] and r["differ"] == [] and r["inv_freq_equal"] and r["rng_equal"]
        assert all(dtype == "torch.float32" for _, dtype in r["shapes"].values())
        # No rank holds the whole model (rank 0 did: its fp32 load, then the shards besides).
        assert r["files"]["grown"] < 0.9 * model_bytes, (rank, r["files"]["grown"], model_bytes)
    assert results[0]["general"]["grown"] > 0.9 * model_bytes  # the measure sees a whole copy
    rows = {rank: results[rank]["shapes"]["model.embed_tokens.weight"][0][0] for rank in (0, 1)}
    assert rows[0] == rows[1] + 1  # an odd vocabulary: rank 1 holds one row fewer


def test_training_and_checkpoints_are_the_general_paths_bit_for_bit(tmp_path):
    from conftest import make_workspace

    ws = make_workspace(tmp_path)
    bf16_folder(ws, tie=True, small=True)  # a tied head: one parameter, read under the embedding's name
    recipe = write_recipe(ws, "full")
    r = load_recipe(recipe, ["training.parallel=fsdp"])
    assert plan_run(r, torch.device("cpu"), World(size=2, backend="gloo"), recipe_model_config(r)).shard_files
    runs = {}
    for name, worker in (("files", train_worker), ("general", general_path_train_worker)):
        runs[name] = ws / name
        launch(worker, recipe, ["training.parallel=fsdp", "training.max_steps=2", "training.save_every=1",
                                f"output.dir={runs[name]}"])
    losses = {name: [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
                     if '"loss"' in line and '"step"' in line] for name, run in runs.items()}
    assert losses["files"] == losses["general"] and len(losses["files"]) == 2
    layout = {name: sorted(str(p.relative_to(run)) for p in (run / "checkpoints").rglob("*") if p.is_file())
              for name, run in runs.items()}
    assert layout["files"] == layout["general"] and any(p.endswith(".distcp") for p in layout["files"])
    for step in ("step-1", "step-2"):
        for shard in (runs["general"] / "checkpoints" / step / "shards").glob("*.distcp"):
            other = runs["files"] / "checkpoints" / step / "shards" / shard.name
            assert other.read_bytes() == shard.read_bytes(), (step, shard.name)
    final = {name: load_file(run / "model" / "model.safetensors") for name, run in runs.items()}
    assert final["files"].keys() == final["general"].keys()
    for name, tensor in final["general"].items():
        assert torch.equal(final["files"][name], tensor), name


def test_the_plan_keeps_the_general_path_where_rank_0_makes_values(tmp_path):
    from conftest import make_workspace

    ws = make_workspace(tmp_path)
    world = World(size=2, backend="gloo")
    full = load_recipe(write_recipe(ws, "full"), ["training.parallel=fsdp"])
    lora = load_recipe(write_recipe(ws, "lora"), ["training.parallel=fsdp"])
    plan = plan_run(full, torch.device("cpu"), world, recipe_model_config(full))
    assert plan.shard_files is not None and plan.load_device.type == "meta"
    assert set(plan.shard_files) == {n for n, _ in Transformer(recipe_model_config(full)).named_parameters()}
    assert {stored for _, stored in plan.shard_files.values()} == set(load_file(ws / "model" / "model.safetensors"))
    plan = plan_run(lora, torch.device("cpu"), world, recipe_model_config(lora))
    assert plan.shard_files is None and plan.load_device.type == "cpu"  # adapters drawn on rank 0
    assert "adapters" in dict(plan.reasons)["fsdp loading"]
    one = plan_run(full, torch.device("cpu"), World(size=1), recipe_model_config(full))
    assert one.shard_files is None and "fsdp loading" not in dict(one.reasons)
    # A tensor that is no parameter of the model: the general path (whose load names it as the error).
    state = load_file(ws / "model" / "model.safetensors")
    state["extra.weight"] = torch.zeros(2)
    from safetensors.torch import save_file

    save_file(state, str(ws / "model" / "model.safetensors"), metadata={"format": "pt"})
    plan = plan_run(full, torch.device("cpu"), world, recipe_model_config(full))
    assert plan.shard_files is None and "extra.weight" in dict(plan.reasons)["fsdp loading"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_on_two_gpus_each_rank_reads_its_shards_bitwise_as_nccls_broadcast_gives_them(tmp_path):
    """The same on CUDA with NCCL: each slice goes to the GPU in the file's bf16 and widens there."""
    from conftest import make_workspace

    ws = make_workspace(tmp_path)
    bf16_folder(ws, small=True)
    recipe = write_recipe(ws, "full")
    results = launch_function(shard_read_worker, (recipe, ["training.parallel=fsdp", "model.device=cuda"], "cuda"),
                              start_method="spawn", shutdown_timeout=5, nproc_per_node=2)
    for r in results.values():
        assert r["files"]["built_on"] == "meta"
        assert r["names_equal"] and r["differ"] == [] and r["inv_freq_equal"] and r["rng_equal"]
