#!/usr/bin/env bash
# Here (with registry access): download, for the GPU machine's Python 3.12, the wheels that
# sglang 0.5.23's storage/host-pool imports need and that its image lacks (it has torch,
# torchvision, transformers, numpy, pillow, psutil, aiohttp, requests, tqdm, pyyaml). About 57 MB:
# carry .whl-sglang alone (the device tool carries at most 64 MiB a call).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl-sglang/' .git/info/exclude 2>/dev/null || echo /.whl-sglang/ >> "$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p .whl-sglang
plat=""
for n in 2_5 2_17 2_24 2_27 2_28 2_31 2_34; do plat+=" --platform manylinux_${n}_x86_64"; done
plat+=" --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
for pkg in sglang==0.5.23 orjson pybase64 starlette msgspec pydantic pydantic-core \
    typing-inspection annotated-types pyzmq ipython ipython-pygments-lexers jedi parso \
    prompt-toolkit pexpect ptyprocess stack-data asttokens executing pure-eval traitlets \
    decorator matplotlib-inline wcwidth dill apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 \
    gguf crc32c zstandard; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $plat -d .whl-sglang "$pkg"
done
du -sh .whl-sglang
