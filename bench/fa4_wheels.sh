#!/usr/bin/env bash
# FlashAttention-4 (CuTe DSL) and what it needs, as wheels for the GPU machine (Python 3.12, CUDA 13), fetched from
# PyPI without installing: bench/varlen_backends.py times it where it imports. The -libs-cu13 wheel alone is about
# 92 MB, more than one device call carries, so the set is split into two folders that travel in two calls:
#   bash bench/fa4_wheels.sh            # -> .fa4a/ (libs-cu13 first half) and .fa4b/ (second half + the rest)
# On the device: cat .fa4a/part.* .fa4b/part.* > "$(cat .fa4b/libs_name)", then pip install --no-deps --target
# /tmp/site it and the other wheels (cuda-bindings >= 12.8 too, where the image lacks it), and put
# /tmp/site/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH: the wheel adds it through a .pth file, which a --target
# folder on PYTHONPATH does not run (2026-11-26: `import cutlass` failed on the GPU machine without it).
set -euo pipefail
tmp=$(mktemp -d)
pip download -q --no-deps --pre --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: -d "$tmp" \
  "flash-attn-4==4.0.0b36" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1" \
  "nvidia-cutlass-dsl-libs-cu13==4.8.1" "apache-tvm-ffi==0.1.15.post2" "torch-c-dlpack-ext==0.1.5" \
  "quack-kernels==0.6.5" "nvidia-cutlass-dsl-libs-core==4.8.1" "einops==0.8.1"
mkdir -p .fa4a .fa4b
libs=$(ls "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl)
split -b 40M -d "$libs" "$tmp/part."
mv "$tmp/part.00" "$tmp"/nvidia_cutlass_dsl_libs_core-*.whl .fa4a/ && mv "$tmp"/part.0* .fa4b/
basename "$libs" > .fa4b/libs_name
rm "$libs" && mv "$tmp"/*.whl .fa4b/
du -sh .fa4a .fa4b
