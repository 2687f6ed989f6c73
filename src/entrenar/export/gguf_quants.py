"""ggml's k-quants (Q4_K, Q5_K, Q6_K) as numpy, and llama.cpp's per-tensor type rules.

The encoders follow the arithmetic of ggml's reference quantizers
(``quantize_row_q{4,5,6}_K_ref``) step for step in float32: the same scale
searches, the same sequential sums (``cumsum``, not numpy's pairwise ``sum``)
and the same round-half-to-even, so the bytes match the reference built
without fused multiply-add. They run on every block of a tensor at once.

:func:`tensor_types` chooses each tensor's storage type for a file type the
way ``llama-quantize`` does (``llama_tensor_get_type``): the output matrix (or
the token embedding when it is tied to the output) in Q6_K, the ``_M`` mixes'
extra bits on ``attn_v`` and ``ffn_down`` of some layers, and the fallback to a
32-value block type when a row does not split into 256-value super-blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from entrenar.errors import QuantError

QK_K = 256
_F32 = np.float32
_EPS = _F32(1e-15)  # ggml's GROUP_MAX_EPS
_CHUNK = 1 << 22  # values encoded per step, bounding temporary memory

# File types offered by name -> the storage type of an ordinary 2-D weight.
FILE_TYPES = {
    "f32": "F32",
    "f16": "F16",
    "q8_0": "Q8_0",
    "q6_k": "Q6_K",
    "q5_k_m": "Q5_K",
    "q4_k_m": "Q4_K",
    "q4_1": "Q4_1",
    "q4_0": "Q4_0",
}
_BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}
# A k-quant whose rows do not split into super-blocks falls back to a 32-value type, as in llama.cpp.
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers llama.cpp's ``_M`` mixes give more bits: the first and last eighth, and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_types(file_type: str, tensors: Sequence[tuple[str, tuple[int, ...]]]) -> dict[str, str]:
    """The ggml type name of each 2-D weight in ``tensors`` (GGUF name, torch shape) for ``file_type``.

    ``tensors`` are in file order (llama.cpp counts ``attn_v`` and ``ffn_down``
    tensors in that order). 1-D tensors are not listed: they stay F32.
    """
    if file_type not in FILE_TYPES:
        raise QuantError(f"GGUF type {file_type!r} is not supported (supported: {', '.join(FILE_TYPES)})")
    default = FILE_TYPES[file_type]
    weights = [(name, shape) for name, shape in tensors if len(shape) == 2]
    if default in ("F32", "F16"):
        return {name: default for name, _ in weights}
    names = {name for name, _ in weights}
    tied = "output.weight" not in names
    n_v = sum("attn_v.weight" in n for n in names)
    n_down = sum("ffn_down" in n for n in names)
    i_v = i_down = 0
    out = {}
    for name, shape in weights:
        cols = shape[-1]
        kind = default
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            if cols % _BLOCK[default]:
                kind = "Q8_0"
            elif default != "Q8_0":
                kind = "Q6_K"
        elif "attn_v.weight" in name:
            if file_type in ("q4_k_m", "q5_k_m") and _use_more_bits(i_v, n_v):
                kind = "Q6_K"
            i_v += 1
        elif "ffn_down" in name:
            if file_type in ("q4_k_m", "q5_k_m") and _use_more_bits(i_down, n_down):
                kind = "Q6_K"
            i_down += 1
        if cols % _BLOCK[kind]:
            kind = _FALLBACK.get(kind, "F16")
            if cols % _BLOCK.get(kind, 1):
                kind = "F16"  # rows that split into no block type at all
        out[name] = kind
    return out


# -- encoders -------------------------------------------------------------------


def _nearest(x: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int`` (round half to even), kept as float32."""
    return np.rint(x)


def _seqsum(x: np.ndarray) -> np.ndarray:
    """Sum over the first axis one value after the other in float32, as a C loop does (not pairwise)."""
    total = x[0].copy()
    for row in x[1:]:
        total += row
    return total


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Scale and levels (0..2*nmax-1) of each column of ``x`` [16, n]: ggml's make_qx_quants, rmse_type 1."""
    cols = np.arange(x.shape[1])
    mx = x[np.abs(x).argmax(0), cols]
    zero = np.abs(mx) < _EPS
    safe = np.where(zero, _F32(1), mx)
    w = x * x
    wx = w * x
    fn = _F32(nmax)

    def levels(iscale: np.ndarray) -> np.ndarray:
        return np.clip(_nearest(iscale * x), -fn, fn - 1)

    def sums(lv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _seqsum(wx * lv), _seqsum(w * lv * lv)

    lv = levels(-fn / safe)
    sumlx, suml2 = sums(lv)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, _F32(1)), _F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        cand = levels(-(fn + _F32(0.1) * _F32(step)) / safe)
        sumlx, suml2 = sums(cand)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        lv = np.where(better, cand, lv)
        scale = np.where(better, sumlx / np.where(better, suml2, _F32(1)), scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(zero, _F32(0), scale), np.where(zero, _F32(0), lv + fn)


def _make_qkx2_quants(
    x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scale, minus the minimum, and levels (0..nmax) of each column of ``x`` [32, n]: ggml's make_qkx2_quants."""
    av_x = np.sqrt(_seqsum(x * x) / _F32(32))
    w = av_x + np.abs(x)
    wx = w * x
    lo = np.minimum(x.min(0), _F32(0))
    hi = x.max(0)
    flat = hi == lo
    sum_w = _seqsum(w)
    sum_x = _seqsum(wx)
    fn = _F32(nmax)

    def levels(iscale: np.ndarray, mn: np.ndarray) -> np.ndarray:
        return np.clip(_nearest(iscale * (x - mn)), _F32(0), fn)

    def error(scale: np.ndarray, mn: np.ndarray, lv: np.ndarray) -> np.ndarray:
        diff = scale * lv + mn - x
        return _seqsum(w * (diff * diff))

    iscale = fn / np.where(flat, _F32(1), hi - lo)
    scale = _F32(1) / iscale
    mn = lo
    lv = levels(iscale, lo)
    best = error(scale, mn, lv)
    for step in range(nstep + 1):
        # ggml searches from the best minimum so far, not from the row's minimum
        span = np.where(hi == mn, _F32(1), hi - mn)
        cand = levels((_F32(rmin) + _F32(rdelta) * _F32(step) + fn) / span, mn)
        wl = w * cand
        sum_l, sum_l2, sum_xl = _seqsum(wl), _seqsum(wl * cand), _seqsum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = np.where(ok, det, _F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        pos = this_min > 0
        this_scale = np.where(pos, sum_xl / np.where(pos, sum_l2, _F32(1)), this_scale)
        this_min = np.where(pos, _F32(0), this_min)
        cur = error(this_scale, this_min, cand)
        better = ok & (cur < best)
        lv = np.where(better, cand, lv)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    return np.where(flat, _F32(0), scale), -mn, np.where(flat, _F32(0), lv)


def _pack_scale_min(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [n, 8] as the 12 bytes of a Q4_K/Q5_K super-block."""
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return out


def _q45_k(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shared part of Q4_K and Q5_K for super-blocks ``x`` [n, 256]: header bytes and levels."""
    n = x.shape[0]
    scales, mins, lv = _make_qkx2_quants(np.ascontiguousarray(x.reshape(n * 8, 32).T), nmax, rmin, 0.1, nstep)
    scales, mins, lv = scales.reshape(n, 8), mins.reshape(n, 8), lv.T.reshape(n, 8, 32)
    max_scale = np.maximum(scales.max(-1), _F32(0))
    max_min = np.maximum(mins.max(-1), _F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0)).astype(_F32)
        inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0)).astype(_F32)
    # C stores the rounded value in a uint8_t (wrapping) before clamping to 63
    ls = np.minimum(_nearest(inv_scale[:, None] * scales).astype(np.int32).astype(np.uint8), 63)
    lm = np.minimum(_nearest(inv_min[:, None] * mins).astype(np.int32).astype(np.uint8), 63)
    d = _fp16(max_scale / _F32(63))
    dmin = _fp16(max_min / _F32(63))
    dd = d.astype(_F32)[:, None] * ls.astype(_F32)
    dm = dmin.astype(_F32)[:, None] * lm.astype(_F32)
    xs = x.reshape(n, 8, 32)
    nz = dd != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(_nearest((xs + dm[..., None]) / np.where(nz, dd, _F32(1))[..., None]), 0, nmax)
    lv = np.where(nz[..., None], again, lv).reshape(n, QK_K).astype(np.uint8)
    head = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), _pack_scale_min(ls, lm)], -1)
    return head, lv, x


def _encode_q4_k(x: np.ndarray) -> np.ndarray:
    head, lv, _ = _q45_k(x, 15, -1.0, 20)
    g = lv.reshape(-1, 4, 2, 32)
    qs = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([head, qs], -1)


def _encode_q5_k(x: np.ndarray) -> np.ndarray:
    head, lv, _ = _q45_k(x, 31, -0.5, 15)
    g = lv.reshape(-1, 4, 2, 32)  # [n, pair of 32-value groups, low/high group, 32]
    low = g & 0xF
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    hi = (g >> 4).astype(np.uint8)  # the fifth bit
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, :, None]
    qh = ((hi[:, :, 0] << shifts) | (hi[:, :, 1] << (shifts + 1))).sum(1, dtype=np.uint8)
    return np.concatenate([head, qh, qs], -1)


def _encode_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    scales, lv = _make_qx_quants(np.ascontiguousarray(x.reshape(n * 16, 16).T), 32)
    scales, lv = scales.reshape(n, 16), lv.T.reshape(n, 16, 16)
    at = np.abs(scales).argmax(-1)
    max_scale = scales[np.arange(n), at]
    empty = np.abs(max_scale) < _EPS
    with np.errstate(divide="ignore"):
        iscale = (_F32(-128) / np.where(empty, _F32(1), max_scale)).astype(_F32)
    d = _fp16(_F32(1) / iscale)
    sc = np.minimum(_nearest(iscale[:, None] * scales), 127).astype(np.int8)
    dd = d.astype(_F32)[:, None] * sc.astype(_F32)
    nz = dd != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(_nearest(x.reshape(n, 16, 16) / np.where(nz, dd, _F32(1))[..., None]), -32, 31) + 32
    lv = np.where(nz[..., None], again, lv).reshape(n, 2, 4, 32).astype(np.uint8)  # [n, half, quarter, 32]
    low = lv & 0xF
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], -1).reshape(n, 128)
    hb = lv >> 4
    qh = (hb[:, :, 0] | (hb[:, :, 1] << 2) | (hb[:, :, 2] << 4) | (hb[:, :, 3] << 6)).reshape(n, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d[:, None].view(np.uint8)], -1)
    out[empty] = 0
    return out


_ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": _encode_q4_k,
    "Q5_K": _encode_q5_k,
    "Q6_K": _encode_q6_k,
}


def quantize_k(w: np.ndarray, kind: str) -> np.ndarray:
    """``w`` (float32, rows over the last axis, a multiple of 256 long) as ggml ``kind`` bytes, row by row."""
    if kind not in _ENCODERS:
        raise QuantError(f"no k-quant encoder for {kind}")
    w = np.ascontiguousarray(w, dtype=_F32)
    if w.ndim == 0 or w.shape[-1] % QK_K:
        raise QuantError(f"{kind} needs rows of a multiple of {QK_K} values, got shape {w.shape}")
    blocks = w.reshape(-1, QK_K)
    step = max(1, _CHUNK // QK_K)
    parts = [_ENCODERS[kind](blocks[i : i + step]) for i in range(0, blocks.shape[0], step)]
    out = np.concatenate(parts) if parts else np.zeros((0, 0), np.uint8)
    return out.reshape(*w.shape[:-1], -1)


__all__ = ["FILE_TYPES", "QK_K", "quantize_k", "tensor_types"]
