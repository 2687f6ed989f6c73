"""Choosing the parallel mode and refusing what does not compose, without processes or a GPU."""

from __future__ import annotations

import types

import pytest
import torch

from entrenar.config import load_recipe
from entrenar.distributed.parallelize import bucket_mb, choose_mode, refuse
from entrenar.distributed.world import World
from entrenar.errors import ConfigError
from entrenar.train.memory import estimate_training_memory

TWO = World(rank=0, size=2, backend="nccl")


def recipe(ws, *overrides):
    path = ws / "r.yaml"
    path.write_text(f"model: {{path: {ws / 'model'}}}\ndata: {{train: {ws / 'train.jsonl'}, seq_len: 64}}\n"
                    "lora: {r: 4}\ntraining: {batch_size: 2}\n")
    return load_recipe(path, list(overrides))


def test_auto_takes_ddp_when_the_estimated_replica_fits_the_device_else_fsdp(workspace, monkeypatch):
    from entrenar import read_model_config

    full = recipe(workspace, "lora=null")
    need = estimate_training_memory(read_model_config(workspace / "model"), "full", 2, 64, dtype_bytes=4).total
    cuda = torch.device("cuda", 0)
    for memory, mode in ((need / 0.85 + 1, "ddp"), (need / 0.85 - 1, "fsdp")):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d, m=memory: types.SimpleNamespace(
            total_memory=m))
        assert choose_mode(full, TWO, cuda) == mode
    assert choose_mode(full, TWO, torch.device("cpu")) == "ddp"  # the host's memory: sharding saves nothing
    assert choose_mode(full, World(), cuda) == "single"
    assert choose_mode(recipe(workspace, "training.parallel=fsdp"), TWO, torch.device("cpu")) == "fsdp"


def test_combinations_that_do_not_compose_are_refused_with_what_to_change(workspace):
    t = recipe(workspace).training
    refuse("ddp", t, TWO)
    refuse("fsdp", t, TWO)  # QLoRA too: the NF4 base is sharded (test_fsdp.py)
    with pytest.raises(ConfigError, match="training.kernels: false with parallel: fsdp"):
        refuse("fsdp", recipe(workspace, "training.kernels=true").training, TWO)
    graphs = recipe(workspace, "training.cuda_graphs=true", "model.device=cuda").training
    with pytest.raises(ConfigError, match="turn cuda_graphs off to train on 2 processes"):
        refuse("ddp", graphs, TWO)
    refuse("single", graphs, World())


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
