#!/usr/bin/env bash
# Here (with registry access and .venv-vllm built by tests/run_vllm.sh): gather, into the
# git-ignored .whl-vllm/, what vllm_fs_tier.py needs on the GPU machine, which has no vLLM:
#   .whl-vllm/*.whl   Python 3.12 wheels of the fs tier's import chain that the GPU image lacks
#                     (it has torch, transformers, numpy, pillow, psutil, aiohttp, requests, tqdm,
#                     pyyaml; see bench/device/fetch_sglang_wheels.sh), about 25 MB;
#   .whl-vllm/py/     the vLLM modules `import vllm.v1.kv_offload.tiering.fs.manager` loads,
#                     copied from the installed vllm 0.33.0 wheel (about 300 .py files, 4.8 MB;
#                     never committed), plus vllm/fs_io_C.abi3.so.
# Carry [".whl-vllm"] alone (the device tool carries at most 64 MiB a call); gdskv itself runs
# from the tree. vllm's C extension links torch 2.14; the image's torch 2.11 will most likely
# not load it, and the fs tier then runs its pure-Python I/O path: the JSON's vllm_fs_io_C says
# which ran. Checked here on torch 2.13 with only torch and numpy besides these: the fs tier
# imports and runs its Python path.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl-vllm/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null || \
  echo /.whl-vllm/ >> "$(git rev-parse --git-common-dir)/info/exclude"
rm -rf .whl-vllm && mkdir -p .whl-vllm/py
plat=""
for n in 2_17 2_27 2_28 2_31 2_34; do plat+=" --platform manylinux_${n}_x86_64"; done
plat+=" --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $plat -d .whl-vllm \
  Pygments==2.21.0 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 \
  apache-tvm-ffi==0.1.15.post2 cachetools==8.0.1 cbor2==6.3.0 click==8.5.1 cloudpickle==3.1.2 \
  fastapi==0.136.3 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 llguidance==1.7.6 \
  markdown-it-py==4.3.0 mdurl==0.1.2 msgspec==0.22.0 openai-harmony==0.0.8 openai==3.54.0 \
  partial-json-parser==0.2.1.1.post7 prometheus_client==0.26.0 py-cpuinfo==9.0.0 \
  pybase64==1.5.1 pydantic==2.14.3 pydantic_core==2.50.4 pyzmq==27.3.0 rich==15.0.0 \
  shellingham==1.5.4 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5 typer==0.29.2 \
  typing-inspection==0.4.5 uvloop==0.23.0 xgrammar==0.2.8 xxhash crc32c
.venv-vllm/bin/python - <<'PY'
import os, shutil, sys
before = set(sys.modules)
import vllm.v1.kv_offload.factory  # noqa: F401
import vllm.v1.kv_offload.tiering.factory  # noqa: F401
import vllm.v1.kv_offload.tiering.spec  # noqa: F401
import vllm.v1.kv_offload.tiering.fs.manager  # noqa: F401
import vllm.version  # noqa: F401
site = os.path.dirname(os.path.dirname(vllm.__file__))
files = {m.__file__ for name, m in sys.modules.items()
         if name == "vllm" or name.startswith("vllm.") and getattr(m, "__file__", None)}
files.add(os.path.join(site, "vllm", "fs_io_C.abi3.so"))
for f in files:
    dst = os.path.join(".whl-vllm", "py", os.path.relpath(f, site))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(f, dst)
print(f"{len(files)} vLLM files copied")
PY
du -sh .whl-vllm
