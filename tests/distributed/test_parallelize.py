"""Choosing the parallel mode and refusing what does not compose, without processes or a GPU."""

from __future__ import annotations

import pytest
import torch

from entrenar.config import load_recipe
from entrenar.distributed.parallelize import bucket_mb
from entrenar.distributed.world import World
from entrenar.errors import ConfigError
from entrenar.train.plan import plan_run

TWO = World(rank=0, size=2, backend="nccl")


def recipe(ws, *overrides):
    path = ws / "r.yaml"
    path.write_text(f"model: {{path: {ws / 'model'}}}\ndata: {{train: {ws / 'train.jsonl'}, seq_len: 64}}\n"
                    "lora: {r: 4}\ntraining: {batch_size: 2}\n")
    return load_recipe(path, list(overrides))


def test_auto_takes_ddp_when_the_estimated_replica_fits_the_device_else_fsdp(workspace):
    """parallel: auto weighs one replica (the plan's estimate, with the run's own settings) against the device."""
    from entrenar import read_model_config

    config = read_model_config(workspace / "model")
    full = recipe(workspace, "lora=null", "model.device=cuda")
    cuda = torch.device("cuda", 0)
    need = plan_run(full, cuda, TWO, config, device_memory=2**50, triton=True).memory.total
    for memory, mode in ((need / 0.85 + 1, "ddp"), (need / 0.85 - 1, "fsdp")):
        assert plan_run(full, cuda, TWO, config, device_memory=int(memory), triton=True).mode == mode
    cpu = torch.device("cpu")
    assert plan_run(recipe(workspace, "lora=null"), cpu, TWO, config).mode == "ddp"  # the host's memory is shared
    assert plan_run(full, cuda, World(), config, triton=True).mode == "single"
    assert plan_run(recipe(workspace, "training.parallel=fsdp"), cpu, TWO, config).mode == "fsdp"


def test_combinations_that_do_not_compose_are_refused_with_what_to_change(workspace):
    from entrenar import read_model_config

    config, cpu = read_model_config(workspace / "model"), torch.device("cpu")
    plan_run(recipe(workspace, "training.parallel=ddp"), cpu, TWO, config)
    plan_run(recipe(workspace, "training.parallel=fsdp"), cpu, TWO, config)  # QLoRA too: the NF4 base is sharded
    with pytest.raises(ConfigError, match="training.kernels: false with parallel: fsdp"):
        plan_run(recipe(workspace, "training.kernels=true", "training.parallel=fsdp"), cpu, TWO, config)
    graphs = recipe(workspace, "training.cuda_graphs=true", "model.device=cuda", "training.parallel=fsdp",
                    "training.kernels=false")
    with pytest.raises(ConfigError, match="turn cuda_graphs off to train on 2 processes"):
        plan_run(graphs, torch.device("cuda", 0), TWO, config, triton=True)
    # DDP of adapters reduces one flat buffer outside the graph (entrenar.distributed.flat_grads): graphs stay.
    assert plan_run(recipe(workspace, "training.cuda_graphs=true", "model.device=cuda", "training.parallel=ddp"),
                    torch.device("cuda", 0), TWO, config, triton=True).cuda_graphs
    plan_run(graphs, torch.device("cuda", 0), World(), config, triton=True)


def test_ddp_buckets_hold_an_eighth_of_the_adapter_gradients_between_1_and_25_mib():
    assert bucket_mb(2**20) == 1.0
    assert bucket_mb(80 * 2**20) == 10.0
    assert bucket_mb(2**33) == 25.0


def test_nf4_experts_are_refused_under_fsdp_naming_the_module():
    from entrenar.quant.nf4.experts import NF4Experts
    from entrenar.quant.nf4.sharding import shard_nf4_layers

    model = torch.nn.Module()
    model.mlp = NF4Experts(2, 64, 64, torch.float32, "meta")
    with pytest.raises(ConfigError, match=r"NF4 experts of a mixture-of-experts model \(mlp\).*parallel: ddp"):
        shard_nf4_layers(model, World(rank=0, size=2, backend="gloo"))
