"""A random gpt-oss folder laid out as openai/gpt-oss-20b ships: experts in MXFP4, everything else in bf16.

The release stores each layer's ``mlp.experts.{gate_up,down}_proj`` as ``*_blocks`` uint8 [E, out, in / 32, 16]
(two FP4 E2M1 codes a byte) and ``*_scales`` uint8 [E, out, in / 32] (a power of two per 32 values, biased by
127), and says so in config.json's ``quantization_config`` (``quant_method: mxfp4``). At gpt-oss-20b's shape that
is about 13 GiB where the same weights in bf16 are 39 GiB: three times less to write and to read per row.

The tensors are drawn in one pass over the names and shapes of transformers' own model built on the meta device
(nothing is materialised at full size), on the GPU where there is one (a fixed seed), and written straight into
safetensors shards with an index, as ``save_pretrained`` lays them out. Every bf16 weight is N(0, 0.02)
(transformers' ``initializer_range``), norms are ones; the FP4 codes are uniform bytes with every scale 2^-7, so
the dequantized experts have a standard deviation of about 0.023 (the codes' RMS is 2.93).

    PYTHONPATH=src python bench/gpt_oss_folder.py --tiny --out /tmp/gpt-oss-tiny   # what bench_e2e.py writes
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

# config.json's quantization_config in openai/gpt-oss-20b (transformers reads it as Mxfp4Config)
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
SCALE_EXPONENT = -7  # every block's scale: 2^-7 x the codes' RMS 2.93 = 0.023, near initializer_range 0.02
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
STD = 0.02


def mxfp4_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (blocks, scales) shapes of an expert weight transformers holds as [E, in, out]: the checkpoint keeps
    it as [E, out, in] cut into groups of 32 along ``in``."""
    experts, fan_in, fan_out = shape
    if fan_in % 32:
        raise ValueError(f"an MXFP4 expert weight needs its input width {fan_in} to be a multiple of 32")
    return (experts, fan_out, fan_in // 32, 16), (experts, fan_out, fan_in // 32)


def planned_tensors(config) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name on disk, kind, shape) for every tensor, in the model's order: kind is "blocks", "scales", "ones" (a
    norm) or "normal" (bf16). The names and shapes are transformers' (its model built on the meta device)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    out = []
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        if name.endswith(EXPERT_WEIGHTS):
            blocks, scales = mxfp4_shapes(shape)
            out += [(f"{name}_blocks", "blocks", blocks), (f"{name}_scales", "scales", scales)]
        elif name.endswith("norm.weight"):
            out.append((name, "ones", shape))
        else:
            out.append((name, "normal", shape))
    return out


def write_mxfp4_folder(config, folder: Path, tokenizer_dir: Path | None, device: str = "cpu", seed: int = 0,
                       shard_bytes: int = 4 * 2**30) -> dict[str, float]:
    """Write the folder (through ``folder.partial``, renamed when complete), with the tokenizer files of
    ``tokenizer_dir`` if given; returns the seconds spent drawing the tensors and writing them, and the bytes
    written."""
    import torch
    from safetensors.torch import save_file

    timings = {"draw_s": 0.0, "write_s": 0.0, "bytes": 0}
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    plan = planned_tensors(config)
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for entry in plan:
        nbytes = _nbytes(entry)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    weight_map = {}
    for index, shard in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"  # as save_pretrained names them
        t0 = time.perf_counter()
        tensors = {name: _draw(kind, shape, device, generator).cpu() for name, kind, shape in shard}
        t1 = time.perf_counter()
        save_file(tensors, str(tmp / file_name), metadata={"format": "pt"})
        timings["draw_s"] += t1 - t0
        timings["write_s"] += time.perf_counter() - t1
        timings["bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, file_name))
    index_json = {"metadata": {"total_size": timings["bytes"]}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    hf = config.to_dict()
    hf.update(quantization_config=MXFP4_CONFIG, dtype="bfloat16")
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json") if tokenizer_dir else ():
        shutil.copy(tokenizer_dir / name, tmp / name)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return timings


def _nbytes(entry: tuple[str, str, tuple[int, ...]]) -> int:
    _, kind, shape = entry
    count = 1
    for n in shape:
        count *= n
    return count * (1 if kind in ("blocks", "scales") else 2)


def _draw(kind: str, shape: tuple[int, ...], device: str, generator):
    import torch

    if kind == "blocks":
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)
    if kind == "scales":
        return torch.full(shape, 127 + SCALE_EXPONENT, dtype=torch.uint8, device=device)
    if kind == "ones":
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, STD, generator=generator)


def main() -> None:
    import argparse

    import torch
    from bench_e2e import HF_SHAPES, hf_shape_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="gpt-oss-20b", choices=[s for s in HF_SHAPES if s.startswith("gpt-oss")])
    p.add_argument("--tiny", action="store_true", help="bench_e2e.py's --tiny size")
    p.add_argument("--layers", type=int, default=0, help="this many layers (a timing of part of the folder)")
    p.add_argument("--tokenizer", default=".e2e")
    p.add_argument("--out", required=True)
    p.add_argument("--load", action="store_true", help="then time loading it: entrenar (bf16, MXFP4 dequantized on "
                   "load) and transformers (Mxfp4Config(dequantize=True)), each in this process, on the device")
    args = p.parse_args()
    vocab = len(json.loads((Path(args.tokenizer) / "tokenizer.json").read_text())["model"]["vocab"])
    config = hf_shape_config(args.shape, args.tiny, max(vocab, 49152))
    if args.layers:
        config.num_hidden_layers = args.layers
        config.layer_types = config.layer_types[:args.layers]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (Path(args.out) / "config.json").is_file():  # an existing folder is timed again as it is
        t0 = time.perf_counter()
        timings = write_mxfp4_folder(config, Path(args.out), Path(args.tokenizer), device)
        print(json.dumps({**timings, "total_s": time.perf_counter() - t0, "device": device,
                          "torch_threads": torch.get_num_threads(), "GiB": timings["bytes"] / 2**30}), flush=True)
    if args.load:
        print(json.dumps(time_loads(Path(args.out), device)))


def time_loads(folder: Path, device: str) -> dict[str, float]:
    """Seconds to load ``folder`` onto ``device`` in bf16 (wall, and the CPU time of all this process's threads):
    entrenar's loader (experts dequantized as they stream past), then transformers' from_pretrained with
    Mxfp4Config(dequantize=True) (each model freed before the next)."""
    import gc

    import torch
    import transformers

    from entrenar.models.hf import load_hf

    out = {}
    t0, c0 = time.perf_counter(), time.process_time()
    model = load_hf(folder, dtype=torch.bfloat16, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    out["entrenar_load_s"], out["entrenar_load_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    del model
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True),
        device_map={"": device})
    if device == "cuda":
        torch.cuda.synchronize()
    out["transformers_load_s"], out["transformers_load_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    del model
    return out


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
