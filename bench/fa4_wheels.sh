#!/usr/bin/env bash
# FlashAttention-4 (CuTe DSL) and what it needs, as wheels for the GPU machine (Python 3.12, CUDA 13), fetched from
# PyPI without installing: bench/varlen_backends.py times it where it imports. The set is 102 MB (the -libs-cu13
# wheel alone 92 MB), more than one device call carries beside the repository (about 6 MB) and the benchmark's own
# carried folders (.e2e 4 MB; .whl 27 MB where Unsloth's rows run too), so it travels as one tar split into parts,
# one part a call, to the same warm machine:
#   bash bench/fa4_wheels.sh                 # -> .fa4a/ .fa4b/ (sizes: FA4_PARTS, MiB; one more part takes the rest)
#   FA4_PARTS="52" bash bench/fa4_wheels.sh     # the default: a call with the repository (and .e2e), then one
#                                               # with .e2e; FA4_PARTS="26 52" -> three parts where .whl travels too
# On the device, each call copies its part to /root/fa4/ (the machine keeps it while warm, idle under 30 s between
# calls); the last call joins and installs them:
#   cat /root/fa4/part.* | tar -x -C /root/fa4 && python3 -m pip install -q --no-deps --no-index --target /tmp/site \
#     /root/fa4/*.whl
# and puts /tmp/site/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH: the wheel adds it through a .pth file, which a
# --target folder on PYTHONPATH does not run (2026-11-26: `import cutlass` failed on the GPU machine without it).
set -euo pipefail
tmp=$(mktemp -d)
pip download -q --no-deps --pre --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: -d "$tmp" \
  "flash-attn-4==4.0.0b36" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1" \
  "nvidia-cutlass-dsl-libs-cu13==4.8.1" "apache-tvm-ffi==0.1.15.post2" "torch-c-dlpack-ext==0.1.5" \
  "quack-kernels==0.6.5" "nvidia-cutlass-dsl-libs-core==4.8.1" "einops==0.8.1"
tar -C "$tmp" -cf "$tmp/fa4.tar" $(cd "$tmp" && ls *.whl)
read -r -a sizes <<< "${FA4_PARTS:-52}"
names=(.fa4a .fa4b .fa4c .fa4d .fa4e)
rm -rf "${names[@]}"
skip=0
for i in $(seq 0 "${#sizes[@]}"); do
  dir=${names[$i]}; mkdir -p "$dir"
  if [ "$i" -lt "${#sizes[@]}" ]; then
    dd if="$tmp/fa4.tar" of="$dir/part.$i" bs=1M skip="$skip" count="${sizes[$i]}" status=none
    skip=$((skip + sizes[i]))
  else
    dd if="$tmp/fa4.tar" of="$dir/part.$i" bs=1M skip="$skip" status=none
  fi
done
rm -rf "$tmp"
du -sh .fa4?
