"""Worker functions of the context-parallelism tests (2 gloo processes, forked)."""

from __future__ import annotations

import torch

from entrenar.models.config import ModelConfig

# Four documents end to end, 25 tokens: the slices of 2 ranks (13 tokens each, a filler token added) cut the
# second document (tokens 5-14) in two.
DOCUMENT_LENGTHS = (5, 10, 6, 4)


def padding_free_row(vocab: int, seed: int = 1) -> dict:
    """A padding-free micro-batch as :func:`entrenar.data.padding_free` lays it out (labels unshifted, -100 on
    each document's first token and on a prompt token per document)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(DOCUMENT_LENGTHS)
    ids = torch.randint(0, vocab, (1, n), generator=g)
    labels = ids.clone()
    positions, starts = [], [0]
    for length in DOCUMENT_LENGTHS:
        labels[0, starts[-1]] = -100
        labels[0, starts[-1] + 1] = -100  # a prompt token: no loss
        positions += list(range(length))
        starts.append(starts[-1] + length)
    return {"input_ids": ids, "labels": labels, "position_ids": torch.tensor([positions]),
            "cu_seqlens": torch.tensor(starts, dtype=torch.int32), "max_seqlen": max(DOCUMENT_LENGTHS)}


def grads_worker(configs: list[tuple[dict, bool]], device_type: str = "cpu", dtype: str = "float32") -> list[dict]:
    """For each model config (and whether its layers are recomputed in backward): the loss and gradients of one
    row on this rank alone (the whole row, one process), and the same row split over all the ranks (context
    parallel; gradients summed over the ranks); on ``device_type`` in ``dtype``."""
    from entrenar.distributed import world as world_module
    from entrenar.distributed.context_parallel import context_parallel
    from entrenar.distributed.parallelize import Single
    from entrenar.models.loss import token_cross_entropy
    from entrenar.models.transformer import Transformer

    world, device = world_module.join(torch.device(device_type), 60)
    cp = world.size
    try:
        out = []
        for options, checkpointing in configs:
            torch.manual_seed(0)
            model = Transformer(ModelConfig(**options))
            model.reset_parameters()
            model.to(device, getattr(torch, dtype))
            model.set_activation_checkpointing(checkpointing)
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in padding_free_row(model.config.vocab_size).items()}
            inputs = (batch["input_ids"], batch["position_ids"])
            layout = {"cu_seqlens": batch["cu_seqlens"], "max_seqlen": batch["max_seqlen"]}

            loss, targets = token_cross_entropy(model(*inputs, **layout), batch["labels"])
            (loss / targets).backward()
            one = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
            model.zero_grad()

            step = context_parallel(Single(model), world, cp, device)
            mine = step.shard(batch)
            local, local_targets = token_cross_entropy(step(mine["input_ids"], mine["position_ids"],
                                                            cu_seqlens=mine["cu_seqlens"],
                                                            max_seqlen=mine["max_seqlen"]), mine["labels"])
            every = world.all_sum(torch.stack([local.detach(), local_targets.float()]))
            (local / every[1]).backward()
            split = {n: world.all_sum(p.grad.float()).cpu() for n, p in model.named_parameters()}
            out.append({"loss": float(loss.detach() / targets), "targets": int(targets),
                        "split_loss": float(every[0] / every[1]),
                        "split_targets": int(every[1]), "local_tokens": mine["input_ids"].shape[1],
                        "one": one, "split": split})
        return out
    finally:
        world_module.leave()


def split_train_worker(recipe_path: str, overrides: list[str]) -> tuple[float | None, str, list[tuple[int, int]]]:
    """``entrenar.train`` of a recipe on this rank; (the final loss, the summary, and per micro-batch the row's
    length and this rank's slice of it)."""
    from entrenar.config import load_recipe
    from entrenar.distributed.context_parallel import ContextParallel
    from entrenar.train.loop import train

    seen: list[tuple[int, int]] = []
    real_shard = ContextParallel.shard

    def shard(self, batch):
        mine = real_shard(self, batch)
        seen.append((batch["input_ids"].shape[1], mine["input_ids"].shape[1]))
        return mine

    ContextParallel.shard = shard
    result = train(load_recipe(recipe_path, overrides), progress=False)
    return result.final_loss, result.summary, seen
