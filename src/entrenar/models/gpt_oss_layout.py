"""gpt-oss checkpoints: their MoE tensors' names and layout on disk, and MXFP4 expert weights dequantized on load.

transformers keeps gpt-oss's experts as ``mlp.experts.gate_up_proj`` [E, H, 2I] with gate and up *interleaved*
(columns 0, 2, 4... gate, 1, 3, 5... up), ``gate_up_proj_bias`` [E, 2I] interleaved alike, ``down_proj`` [E, I, H]
and ``down_proj_bias`` [E, H], and names the router ``mlp.router``. The decoder's :class:`~entrenar.models.moe.
Experts` hold ``[E, out, in]`` with gate rows first, as every other MoE family here (so grouped products, expert
LoRA, NF4 and the kernels work alike), and the router is ``mlp.gate``: these functions translate both ways.

The released checkpoints store the expert weights in MXFP4 (transformers' ``integrations/mxfp4.py``):
``{gate_up,down}_proj_blocks`` uint8 [E, out, in / 32, 16] (two FP4 E2M1 codes a byte, low nibble first) and
``{gate_up,down}_proj_scales`` uint8 [E, out, in / 32] (a power of two per 32 values, biased by 127); each pair is
dequantized here as it streams past, on the device of the model's experts (on the CPU it takes about half a
CPU-minute per gpt-oss-20b layer; ``bench/gpt_oss_folder.py --load`` times it), and a saved folder holds the
full-precision weights.

Where the experts are NF4 (QLoRA's frozen base), each stacked weight is handed on one expert at a time under the
NF4 experts' names (``mlp.experts.{e}.{gate,up,down}_proj.weight``, gate and up split apart), and an MXFP4 pair
is dequantized one expert at a time too: no more than one expert's full-precision projection exists at once.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator

import torch

from entrenar.errors import ModelError

# The 16 values of an FP4 (E2M1) code, as transformers' FP4_VALUES.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.)(experts\.(?:gate_up_proj|down_proj)(?:_bias|_blocks|_scales)?|"
                      r"router\.(?:weight|bias))$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 ``blocks`` uint8 [E, rows, G, 16] and ``scales`` uint8 [E, rows, G] -> [E, rows, G x 32] in ``dtype``
    (the weight as [E, out, in]), one expert at a time."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ModelError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         "(blocks [..., G, 16], scales [..., G])")
    if blocks.is_meta:
        return torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype, device="meta")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype, device=blocks.device)
    for e in range(blocks.shape[0]):
        codes = blocks[e].to(torch.uint8)
        values = torch.stack([lut[(codes & 0x0F).int()], lut[(codes >> 4).int()]], dim=-1).flatten(-2)  # [rows, G, 32]
        exponent = scales[e].to(torch.int32) - 127
        out[e] = torch.ldexp(values, exponent[..., None].float()).flatten(-2).to(dtype)
    return out


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate entries (even positions along ``dim``) first, then up (odd)."""
    n = t.shape[dim]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]).to(t.device)
    return t.index_select(dim, order)


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    n = t.shape[dim]
    order = torch.stack([torch.arange(n // 2), torch.arange(n // 2, n)], dim=1).flatten().to(t.device)
    return t.index_select(dim, order)


def _per_expert(prefix: str, rest: str, weights: Iterator[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert by expert, ``(name, weight)`` of a stacked weight under NF4 experts' names, from its [out, in]
    matrices in the decoder's orientation (gate_up: interleaved rows, split into gate and up here)."""
    for e, w in enumerate(weights):
        if rest.startswith("experts.gate_up_proj"):
            yield f"{prefix}experts.{e}.gate_proj.weight", w[0::2].contiguous()
            yield f"{prefix}experts.{e}.up_proj.weight", w[1::2].contiguous()
        else:
            yield f"{prefix}experts.{e}.down_proj.weight", w.contiguous()


def to_ours(tensors: Iterator[tuple[str, str, torch.Tensor]],
            device: torch.device | str | None = None,
            per_expert: Collection[str] = ()) -> Iterator[tuple[str, str, torch.Tensor]]:
    """A gpt-oss checkpoint's (file, name, tensor) stream under the decoder's names and layout; MXFP4 pairs
    dequantized (to fp32; the model's parameters cast them) once both halves have come, on ``device`` if given
    (the model's: the packed bytes cross to a GPU, a quarter of the fp32 weight's size). The MoE layers whose
    prefix (``model.layers.{i}.mlp.``) is in ``per_expert`` get their expert weights one expert at a time under
    the NF4 experts' names (:func:`_per_expert`)."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}  # one half of an MXFP4 pair, by the weight's name
    for file_name, name, tensor in tensors:
        match = _EXPERTS.match(name)
        if match is None:
            yield file_name, name, tensor
            continue
        prefix, rest = match.groups()
        if rest.startswith("router."):
            yield file_name, prefix + rest.replace("router.", "gate."), tensor
        elif rest.endswith(("_blocks", "_scales")):
            weight = prefix + rest.rsplit("_", 1)[0]
            if weight not in pending:
                pending[weight] = (rest, tensor)
                continue
            other_rest, other = pending.pop(weight)
            blocks, scales = (tensor, other) if rest.endswith("_blocks") else (other, tensor)
            if not (rest.endswith("_blocks") ^ other_rest.endswith("_blocks")):
                raise ModelError(f"{file_name}: tensor '{name}' comes twice")
            if prefix in per_expert:
                experts = (dequantize_mxfp4(blocks[e:e + 1].to(device or blocks.device),
                                            scales[e:e + 1].to(device or scales.device))[0]
                           for e in range(blocks.shape[0]))
                yield from ((file_name, n, w) for n, w in _per_expert(prefix, rest, experts))
                continue
            if device is not None:
                blocks, scales = blocks.to(device), scales.to(device)
            dense = dequantize_mxfp4(blocks, scales)  # [E, out, in]: ours, gate and up interleaved
            yield file_name, weight, _deinterleave(dense, 1) if weight.endswith("gate_up_proj") else dense
        elif prefix in per_expert and rest in ("experts.gate_up_proj", "experts.down_proj"):
            yield from ((file_name, n, w) for n, w in _per_expert(prefix, rest, (t.T for t in tensor)))
        elif rest == "experts.gate_up_proj":
            yield file_name, prefix + rest, _deinterleave(tensor.transpose(1, 2), 1)
        elif rest == "experts.gate_up_proj_bias":
            yield file_name, prefix + rest, _deinterleave(tensor, 1)
        elif rest == "experts.down_proj":
            yield file_name, prefix + rest, tensor.transpose(1, 2)
        else:  # down_proj_bias: the same on both sides
            yield file_name, prefix + rest, tensor
    if pending:
        name, (rest, _) = next(iter(pending.items()))
        raise ModelError(f"MXFP4 weight '{name}' has its {rest.rsplit('_', 1)[1]} but not its "
                         f"{'scales' if rest.endswith('_blocks') else 'blocks'}")


def to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder's state dict under gpt-oss's names and layout (full precision, as save_pretrained writes it)."""
    out = {}
    for name, tensor in state.items():
        match = _EXPERTS.match(name.replace(".mlp.gate.", ".mlp.router."))
        if match is None:
            out[name] = tensor
            continue
        prefix, rest = match.groups()
        if rest == "experts.gate_up_proj":
            tensor = _interleave(tensor, 1).transpose(1, 2)
        elif rest == "experts.gate_up_proj_bias":
            tensor = _interleave(tensor, 1)
        elif rest == "experts.down_proj":
            tensor = tensor.transpose(1, 2)
        out[prefix + rest] = tensor.contiguous()
    return out
