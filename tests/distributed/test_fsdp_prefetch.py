"""FSDP2 prefetching (training.fsdp_prefetch) on gloo processes: each block issues the next block's all-gathers,
its parameters' (FSDP2's explicit prefetch lists) and a sharded NF4 base's (one collective per block, issued one
block ahead, forward and backward); the training run's numbers are those of a run without it, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_fixtures import shared  # noqa: E402, F401  (a fixture)
from test_data_parallel import losses, weights  # noqa: E402
from workers import launch, train_worker  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LAYERS = 4


def schedule_worker(checkpointing: bool) -> dict:
    """A 4-block QLoRA model sharded with prefetch, one forward and backward: each block's FSDP prefetch lists
    (as block indices) and the NF4 gathers in the order they were issued and waited for."""
    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.distributed import world as world_module
    from entrenar.distributed.parallelize import parallelize
    from entrenar.models.config import ModelConfig, rope_inv_freq
    from entrenar.models.transformer import Transformer
    from entrenar.quant.nf4 import sharding
    from entrenar.quant.nf4.format import quantize_model_nf4

    world, device = world_module.join(torch.device("cpu"), 30)
    try:
        torch.manual_seed(0)
        config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=LAYERS, num_heads=4,
                             num_kv_heads=2, model_type="llama")
        model = Transformer(config)
        model.reset_parameters()
        model.inv_freq = rope_inv_freq(config)
        quantize_model_nf4(model, "all-linear")
        apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0))
        model.set_activation_checkpointing(checkpointing)
        model.train()
        step_model = parallelize(model, "fsdp", world, device)
        blocks = list(model.model.layers)
        index = {id(b._get_fsdp_state()): i for i, b in enumerate(blocks)}
        lists = [([index[id(s)] for s in b._get_fsdp_state()._states_to_forward_prefetch],
                  [index[id(s)] for s in b._get_fsdp_state()._states_to_backward_prefetch]) for b in blocks]
        gathers = step_model.nf4_gathers
        which = {id(g): i for i, g in enumerate(gathers)}
        events: list[tuple[str, int]] = []
        real_start, real_quantized = sharding.BlockGather.start, sharding.BlockGather.quantized

        def start(self):
            if self._work is None and self._whole is None:
                events.append(("issue", which[id(self)]))
            real_start(self)

        def quantized(self, layer):
            if self._whole is None:
                events.append(("wait", which[id(self)]))
            return real_quantized(self, layer)

        sharding.BlockGather.start, sharding.BlockGather.quantized = start, quantized
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(world.rank))
        step_model(ids).float().square().mean().backward()
        forward = len(events)

        left = [i for i, g in enumerate(gathers) if g._whole is not None or g._work is not None]
        return {"lists": lists, "events": events, "held_after_backward": left,
                "gathers": len(gathers), "layers_per_gather": [len(g.layers) for g in gathers], "n": forward}
    finally:
        world_module.leave()


def expected_events(n: int) -> list[tuple[str, int]]:
    """Forward: entering block i issues i + 1 before block i waits for its own; backward (the last block's codes
    kept from forward): block i's backward issues i - 1 before it waits for i."""
    forward = [("issue", 0)]
    for i in range(n):
        if i + 1 < n:
            forward.append(("issue", i + 1))
        forward.append(("wait", i))
    backward = [("issue", n - 2)]
    for i in range(n - 2, -1, -1):
        if i > 0:
            backward.append(("issue", i - 1))
        backward.append(("wait", i))
    return forward + backward


@pytest.mark.parametrize("checkpointing", [False, True])
def test_each_block_prefetches_the_next_blocks_parameters_and_nf4_codes(checkpointing):
    ranks = launch(schedule_worker, checkpointing)
    for rank in ranks.values():
        assert rank["lists"] == [([i + 1] if i + 1 < LAYERS else [], [i - 1] if i else []) for i in range(LAYERS)]
        assert rank["gathers"] == LAYERS and rank["layers_per_gather"] == [7] * LAYERS  # q k v o gate up down
        assert rank["events"] == expected_events(LAYERS)  # the checkpointed reruns issue nothing more
        assert rank["held_after_backward"] == []  # no block's whole codes outlive the step


@pytest.mark.parametrize("method", ["full", "qlora"])
def test_a_prefetching_run_is_bitwise_the_run_without_it(shared, method):
    """FSDP2 with and without prefetching (and, for QLoRA, the block gathers against the per-projection ones):
    the same losses and final weights, bit for bit; the checkpointed reruns read the prefetched codes too."""
    ws, recipes, _ = shared
    recipe = recipes["full" if method == "full" else "lora"]
    sets = ["training.parallel=fsdp", "training.max_steps=3"]
    if method == "qlora":
        sets += ["lora.quantize_base=nf4", "training.activation_checkpointing=true"]
    runs = {}
    for prefetch in (True, False):
        runs[prefetch] = ws / f"prefetch-{method}-{prefetch}"
        launch(train_worker, recipe, [*sets, f"training.fsdp_prefetch={str(prefetch).lower()}",
                                      f"output.dir={runs[prefetch]}"])
    assert len(losses(runs[True])) == 3 and losses(runs[True]) == losses(runs[False])
    kind = "full" if method == "full" else "lora"
    got, expected = weights(runs[True], kind), weights(runs[False], kind)
    assert got.keys() == expected.keys() and len(got) > 0
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
