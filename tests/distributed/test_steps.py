"""The global step without processes: accumulation from the global batch, and each rank's share of a step."""

from __future__ import annotations

import pytest
import torch

from entrenar.data import BatchStream
from entrenar.data.tokenize import Example
from entrenar.distributed.steps import accumulation, step_batches
from entrenar.distributed.world import World
from entrenar.errors import ConfigError


def test_accumulation_is_derived_from_the_global_batch_or_refused():
    assert accumulation(4, 3, None, 8) == 3  # no global batch: grad_accum as given
    assert accumulation(2, 1, 32, 4) == 4  # 32 rows = 2 per device x 4 x 4 processes
    assert accumulation(2, 4, 32, 4) == 4  # grad_accum agreeing with it is fine
    with pytest.raises(ConfigError, match=r"global_batch_size \(30\) must be a multiple of .* \(2 x 4 = 8\)"):
        accumulation(2, 1, 30, 4)
    with pytest.raises(ConfigError, match=r"grad_accum \(2\) contradicts"):
        accumulation(2, 2, 32, 4)


def examples(n: int) -> list[Example]:
    return [Example(input_ids=list(range(1, 2 + i % 5)), labels=list(range(1, 2 + i % 5))) for i in range(n)]


def test_ranks_split_each_global_step_of_the_one_process_stream_and_end_at_its_position():
    data = examples(23)
    one = BatchStream(data, 2, 8, seed=3)
    ranks = [BatchStream(data, 2, 8, seed=3) for _ in range(3)]
    for _ in range(4):  # 4 steps of 3 processes x 2 accumulation, crossing an epoch boundary
        expected = [next(one) for _ in range(6)]
        for rank, stream in enumerate(ranks):
            mine = step_batches(stream, 2, World(rank=rank, size=3))
            for got, want in zip(mine, expected[2 * rank: 2 * rank + 2], strict=True):
                for key in want:
                    assert torch.equal(got[key], want[key]), key
            assert stream.state_dict() == one.state_dict()
