"""The decode step of batched sampling replayed from a CUDA graph: one launch per token instead of hundreds.

An eager decode step of a 1B model launches a few hundred kernels (every projection, adapter product, norm and
rotation of every layer) for one token per row; the host spends longer launching them than the GPU spends running
them. :class:`StaticDecoder` records one step once and replays it per token. What replaying needs, and how it is
met here:

* tensors at fixed addresses: the keys and values live in a :class:`StaticKVCache` preallocated to
  ``prompt + max_new_tokens`` columns (rounded up to :data:`LENGTH_BUCKET`) by the prefill, which runs eagerly
  before capture; the step reads its token ids, positions and write column from tensors of its own that are
  updated in place between replays; the attention mask is computed inside the graph from the column;
* no host read inside the step: the column is a device tensor, keys past it are masked (not sliced off), so every
  step attends over the same number of columns;
* a few eager calls first, on a side stream, so cuBLAS picks its kernels and Triton compiles before capture (they
  write the same keys and values the first replay writes).

Sampling stays outside the graph, on the step's logits, with the eager path's code and generator: a given seed
draws the same tokens from the same logits whichever way they were computed, and the generator (a CPU one for
GRPO, saved in checkpoints) needs no graph-safe state. One graph is captured per :func:`generate_batch` call (its
batch size and cache length); it is freed with the call, so a model whose weights or adapters change between calls
is never replayed stale.

Where a graph cannot replay (:func:`graph_refusal`: a CPU model, forward hooks such as weight streaming's or
FSDP's, compiled blocks, an input-embedding table in CPU memory, MoE experts run as a loop, dynamic NTK or
interleaved RoPE), the step runs eagerly on the growing cache, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from entrenar.errors import ModelError
from entrenar.models.moe import MoeBlock, core_experts
from entrenar.models.transformer import Transformer, compute_device, soft_cap
from entrenar.quant.nf4.experts import NF4Experts

LENGTH_BUCKET = 64  # columns of the static cache are rounded up to a multiple of this
WARMUP_CALLS = 2  # eager calls of the step on a side stream before capture


class StaticKVCache:
    """Keys and values of ``size`` columns per layer, allocated by the first :meth:`update` (the prefill).

    ``update`` writes the call's keys and values at ``columns`` (a device tensor, so a captured step writes
    wherever the column tensor points when replayed) and returns the whole buffers: attention masks the columns
    not yet written. Duck-types :class:`~entrenar.models.transformer.KVCache` for the model's layers (keys and
    values of any layer kind, MLA's latent included, with the sequence in dimension 2).
    """

    def __init__(self, num_layers: int, size: int, columns: torch.Tensor) -> None:
        self.size = size
        self.columns = columns
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:
            keys = k.new_zeros(*k.shape[:2], self.size, *k.shape[3:])
            values = v.new_zeros(*v.shape[:2], self.size, *v.shape[3:])
            self.keys[layer], self.values[layer] = keys, values
        keys.index_copy_(2, self.columns, k)
        values.index_copy_(2, self.columns, v)
        return keys, values


def cache_columns(width: int, max_new_tokens: int) -> int:
    """Columns of the static cache for prompts ``width`` wide: room for every new token, rounded up to the
    bucket (the last sampled token is never fed back, so ``width + max_new_tokens - 1`` would do)."""
    need = width + max_new_tokens
    return -(-need // LENGTH_BUCKET) * LENGTH_BUCKET


def graph_refusal(model: Transformer) -> str | None:
    """Why ``model``'s decode step cannot replay from a CUDA graph, or None when it can."""
    device = compute_device(model)
    if device.type != "cuda":
        return f"the model computes on {device.type}, not CUDA"
    for name, module in model.named_modules():
        if module._forward_pre_hooks or module._forward_hooks:
            return (f"module '{name or 'model'}' has forward hooks (weight streaming, FSDP, a probe), which run "
                    "host code every call")
        if getattr(module, "_compiled_call_impl", None) is not None:
            return f"module '{name or 'model'}' runs through torch.compile (training.compile), whose guards recompile"
        if isinstance(module, MoeBlock) and isinstance(core_experts(module.experts), NF4Experts):
            return (f"the NF4 experts of '{name}' dequantize their stacks inside the step, which no GPU has "
                    "captured yet")
    if model.model.embed_tokens.weight.device != device:
        return "the input-embedding table stays in CPU memory (training.offload_embeddings)"
    if (model.config.rope_scaling or {}).get("rope_type") == "dynamic":
        return "dynamic NTK RoPE reads the sequence lengths on the host every step"
    if model.config.rope_interleave:
        return "interleaved RoPE copies an index from the host every call"
    for name, module in model.named_modules():
        if isinstance(module, MoeBlock) and not _experts_grouped(module, device):
            return (f"the MoE experts of '{name}' run as a loop over experts, which reads their token counts on "
                    "the host (grouped bf16 experts replay)")
    return None


def _experts_grouped(block: MoeBlock, device: torch.device) -> bool:
    """Whether ``block``'s experts run as one grouped bf16 product on ``device`` (no host read)."""
    experts = block.experts
    use_grouped = getattr(experts, "use_grouped", None)
    hidden = getattr(experts, "hidden_size", None)
    if use_grouped is None or hidden is None:
        return False
    dtype = next((p.dtype for p in experts.parameters() if p.is_floating_point()), torch.float32)
    return dtype == torch.bfloat16 and bool(use_grouped(torch.empty(0, hidden, device=device, dtype=dtype)))


def step_logits(model: Transformer, ids: torch.Tensor, positions: torch.Tensor,
                mask_for: Callable[[int | None], torch.Tensor], cache: object) -> torch.Tensor:
    """Logits [B, V] of each row's last position, as :meth:`Transformer.forward` computes them (embedding and
    logit scales, Gemma's soft cap, each layer's window and RoPE base): ``mask_for(window)`` is the boolean
    attention mask [B, 1, T, columns] under a sliding ``window`` (None: none), ``cache`` a KV cache the layers
    extend (the eager path's and the static one share this)."""
    c = model.config
    x = model.model.embed_tokens(ids)
    if c.embedding_multiplier != 1.0:  # Granite
        x = x * c.embedding_multiplier
    if c.scale_embeddings:  # Gemma: sqrt(hidden) rounded to the model dtype first
        x = x * torch.tensor(c.hidden_size**0.5, dtype=x.dtype)
    cos, sin = model.rope(positions, x.dtype)
    local = model.rope(positions, x.dtype, local=True) if c.rope_local_theta is not None else (cos, sin)
    masks: dict[int | None, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        window = c.layer_window(i)
        if window not in masks:
            masks[window] = mask_for(window)
        layer_cos, layer_sin = local if c.layer_uses_local_rope(i) else (cos, sin)
        x = layer(x, layer_cos, layer_sin, masks[window], cache)
    logits = model.lm_head(model.model.norm(x[:, -1:]))[:, 0]
    if c.logits_scaling != 1.0:  # Granite
        logits = logits / c.logits_scaling
    return soft_cap(logits, c.final_logit_softcapping)


class StaticDecoder:
    """Prefill and decode of a left-padded batch on a :class:`StaticKVCache`; each decode step replayed from a
    CUDA graph (``graph``), or run eagerly on the same buffers (how the CPU tests check the static layout).

    ``prefill()`` returns the logits of every row's last prompt token; ``step(token)`` feeds one token per row and
    returns the next logits (the graph's own output tensor, overwritten by the next step: read it first).
    """

    def __init__(self, model: Transformer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 max_new_tokens: int, graph: bool, strict: bool = False) -> None:
        self.model, self.prompt_ids, self.prompt_mask = model, prompt_ids, prompt_mask
        self.strict = strict  # a capture that fails raises (cuda_graphs: true) instead of going on eagerly
        self.how = "cuda graph" if graph else "eager (static cache)"
        device = prompt_ids.device
        b, width = prompt_ids.shape
        self.size = cache_columns(width, max_new_tokens)
        self.graph_wanted = graph
        # The step's inputs, at fixed addresses: updated in place between replays.
        self.ids = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        self.next_position = self.positions[:, -1:] + 1
        self.column = torch.full((1,), width, dtype=torch.long, device=device)
        self.key_valid = torch.ones(b, self.size, dtype=torch.bool, device=device)
        self.key_valid[:, :width] = prompt_mask.bool()
        self.key_index = torch.arange(self.size, device=device)
        self.cache = StaticKVCache(model.config.num_layers, self.size, torch.arange(width, device=device))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    @torch.no_grad()
    def prefill(self) -> torch.Tensor:
        """Run the prompts eagerly into the cache's first columns; the logits of their last tokens."""
        width = self.prompt_ids.shape[1]
        q = self.key_index[:width, None]
        k = self.key_index[None, :]

        def mask(window: int | None) -> torch.Tensor:
            allowed = (k <= q)[None] & self.key_valid[:, None, :]
            if window is not None:
                allowed = allowed & (q - k < window)[None]
            return (allowed | (k == q)[None])[:, None]

        logits = step_logits(self.model, self.prompt_ids, self.positions, mask, self.cache)
        self.cache.columns = self.column  # from now on each step writes the column the tensor holds
        return logits

    def _decode(self) -> torch.Tensor:
        """One decode step on the static tensors (what the graph records)."""
        k, column = self.key_index, self.column

        def mask(window: int | None) -> torch.Tensor:
            allowed = self.key_valid & (k <= column)
            if window is not None:
                allowed = allowed & (column - k < window)
            return (allowed | (k == column))[:, None, None, :]

        return step_logits(self.model, self.ids, self.next_position, mask, self.cache)

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed ``token`` [B] (each row's last sampled token); the logits [B, V] of the next."""
        self.ids.copy_(token[:, None])
        if self.graph_wanted and self.graph is None:
            try:
                self._capture()
            except RuntimeError as e:  # an operation capture does not allow (a host copy a check above missed)
                if self.strict:
                    raise ModelError(f"cuda_graphs: true, but capturing the decode step failed: {e}") from e
                self.graph_wanted = False
                self.how = f"eager (capturing the decode step failed: {str(e).splitlines()[0] if str(e) else e!r})"
        if self.graph is not None:
            self.graph.replay()
            assert self.logits is not None  # the capture's output
            logits = self.logits
        else:
            logits = self._decode()
        self.column.add_(1)
        self.next_position.add_(1)
        return logits

    def _capture(self) -> None:
        """Warm the step up on a side stream, then record it (the recording does not run it)."""
        stream = torch.cuda.current_stream(self.ids.device)
        side = torch.cuda.Stream(self.ids.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                self._decode()
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (NCCL's watchdog, a checkpoint writer) do not void the capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = self._decode()
        self.graph = graph


def uses_graphs(setting: str | bool, model: Transformer) -> tuple[bool, str]:
    """Whether the decode step replays from a CUDA graph under ``setting`` (auto, True, False), and how it runs
    (``Generated.decode``): "cuda graph", or "eager (why)"."""
    if setting is False:
        return False, "eager (cuda_graphs: false)"
    refusal = graph_refusal(model)
    if refusal is None:
        return True, "cuda graph"
    return False, f"eager ({refusal})"


__all__ = ["LENGTH_BUCKET", "StaticDecoder", "StaticKVCache", "cache_columns", "graph_refusal", "step_logits",
           "uses_graphs"]
