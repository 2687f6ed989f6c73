#!/usr/bin/env bash
# Unsloth on the offline GPU machine (issue 37): its wheels, carried in the repository's ignored .whl/unsloth/.
#
#   bash bench/unsloth_setup.sh download   # here, with PyPI: fetch the wheels, strip Unsloth Studio, report sizes
#   bash bench/unsloth_setup.sh install    # on the GPU machine: install them offline into /tmp/site, import unsloth
#
# download: unsloth and unsloth_zoo ($UNSLOTH_VERSION), and the small packages their import and training path
# reach that the GPU image may lack (read from unsloth's and unsloth_zoo's module-level imports: tyro and its
# docstring_parser/shtab/typeguard, cut_cross_entropy, einops, nest_asyncio, msgspec, pillow (vision_utils
# imports PIL at module level), psutil, requests and its four, sentencepiece, protobuf, typing_extensions, and
# datasets with dill, multiprocess, xxhash and fsspec: unsloth imports datasets when imported, and the GPU image of
# 2026-11-27 had none; datasets below 5, as Unsloth 2026.10.9 declares, and fsspec at what that datasets accepts):
# pure-Python wheels where they exist, CPython 3.12 manylinux x86_64 ones where not. Unsloth's wheel carries
# Unsloth Studio (a web UI, about 25 of its 28.6 MB): `studio/` is dropped and RECORD rewritten to match.
# torchao, xformers, flash-attn, vllm and hf_transfer are left out: Unsloth imports them lazily or only when
# present (attention then runs through PyTorch SDPA).
#
# install: every carried wheel whose module the image cannot already import (the image's own torch, transformers,
# peft, numpy... are never shadowed), with --no-deps, then `import unsloth` under the offline flags bench_e2e.py's
# Unsloth rows set (UNSLOTH_ENV below).
set -euo pipefail
UNSLOTH_VERSION=${UNSLOTH_VERSION:-2026.10.9}
DIR=${UNSLOTH_WHEELS:-.whl/unsloth}
SITE=${SITE:-/tmp/site}
# wheel name prefix -> module the image is checked for (a wheel is installed only where the module is missing)
PURE="tyro:tyro docstring_parser:docstring_parser shtab:shtab typeguard:typeguard cut_cross_entropy:cut_cross_entropy
einops:einops nest_asyncio:nest_asyncio requests:requests urllib3:urllib3 idna:idna charset_normalizer:charset_normalizer
certifi:certifi protobuf:google.protobuf typing_extensions:typing_extensions datasets:datasets dill:dill
multiprocess:multiprocess fsspec:fsspec"
BINARY="msgspec:msgspec pillow:PIL psutil:psutil sentencepiece:sentencepiece xxhash:xxhash"
# the version a wheel is downloaded at, where not the newest
spec() { case "$1" in datasets) echo "datasets<5" ;; fsspec) echo "fsspec<=2025.10.0" ;; *) echo "$1" ;; esac; }
# what bench_e2e.py's Unsloth rows export too: no hub, no statistics call, compiled code outside the repository
UNSLOTH_ENV="HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
UNSLOTH_COMPILE_LOCATION=/tmp/unsloth_compiled_cache TOKENIZERS_PARALLELISM=false"

download() {
  mkdir -p "$DIR"
  rm -f "$DIR"/*.whl
  local tmp; tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" "unsloth==$UNSLOTH_VERSION" "unsloth_zoo==$UNSLOTH_VERSION"
  # for the GPU machine's CPython 3.12 on x86_64 Linux, whatever Python runs this
  python3 -m pip download -q --no-deps -d "$DIR" --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    $(for p in $PURE $BINARY; do spec "${p%%:*}"; done)
  cp "$tmp"/unsloth_zoo-*.whl "$DIR"/
  python3 - "$tmp"/unsloth-"$UNSLOTH_VERSION"-py3-none-any.whl "$DIR" <<'EOF'
import base64, hashlib, sys, zipfile
from pathlib import Path

src, out = Path(sys.argv[1]), Path(sys.argv[2]) / Path(sys.argv[1]).name
drop = lambda name: name.startswith("studio/")  # Unsloth Studio: a web UI the library never imports
with zipfile.ZipFile(src) as z, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as w:
    record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    kept = [i for i in z.infolist() if not drop(i.filename) and i.filename != record]
    lines = []
    for info in kept:
        data = z.read(info)
        w.writestr(info, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{info.filename},sha256={digest},{len(data)}")
    w.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
print(f"{src.name}: {src.stat().st_size / 2**20:.1f} MiB -> {out.stat().st_size / 2**20:.1f} MiB without studio/")
EOF
  rm -rf "$tmp"
  ls -l "$DIR"
  for d in "$DIR" .whl .e2e; do du -sh "$d" 2>/dev/null || true; done
  echo "carry total (.whl + .e2e): $(du -scm .whl .e2e 2>/dev/null | tail -1 | cut -f1) MiB (limit 64)"
}

install() {
  mkdir -p "$SITE"
  local wheels=("$DIR"/unsloth-*.whl "$DIR"/unsloth_zoo-*.whl) entry name module
  for entry in $PURE $BINARY; do
    name=${entry%%:*}; module=${entry#*:}
    if python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('$module') is None)" 2>/dev/null; then
      echo "image has $module: $name not installed"
    else
      wheels+=("$(ls "$DIR"/"$name"-*.whl | head -1)")
    fi
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
  env $UNSLOTH_ENV PYTHONPATH="$SITE:${PYTHONPATH:-}" python3 -c \
    "import unsloth, unsloth_zoo, transformers, torch; from unsloth import FastLanguageModel; print('unsloth', unsloth.__version__, 'zoo', unsloth_zoo.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
}

case "${1:-}" in
  download) download ;;
  install) install ;;
  *) echo "usage: bash bench/unsloth_setup.sh download|install" >&2; exit 2 ;;
esac
