"""An engine calling gdskv directly from its own GPU KV pool.

The engine keeps a layer-first paged KV pool on the GPU (per layer K and V, rows addressed by
token slot). When it evicts a finished request's prefix it spills those pages to NVMe with
``tier.put``; when a new request shares the prefix it asks ``tier.match_prefix`` how many pages
are stored and restores them into freshly allocated slots with ``tier.get``. On a GPU the pages are
packed on the GPU and written by kvikio (GPUDirect Storage where the platform has it, cuFile
compat mode otherwise: ``stats()`` says which). Without a GPU the same code runs on CPU with the
POSIX backend.

    python examples/engine_direct.py [--dir /mnt/nvme0/gdskv]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile

import torch

from gdskv import KVLayout, TierConfig
from gdskv.memory import cuda_available
from gdskv.tier import Tier


def page_keys(tokens: list[int], page_size: int) -> list[str]:
    """Chained SHA-256 of each full page of token ids: equal prefixes give equal keys."""
    keys, prev = [], b""
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        prev = hashlib.sha256(prev + repr(tokens[i:i + page_size]).encode()).digest()
        keys.append(prev.hex())
    return keys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="store directory (default: a temporary one)")
    args = ap.parse_args()
    device = torch.device("cuda" if cuda_available() else "cpu")

    # The engine's KV geometry and its pool: 8 layers, 8 KV heads of 128, bf16, 16-token pages.
    layout = KVLayout(num_layers=8, page_size=16, head_dim=128, kv_heads=8, dtype="bf16",
                      model_name="example-8b", tp_rank=0, tp_size=1)
    num_slots = 4096
    k_pool = torch.randn(layout.num_layers, num_slots, layout.kv_heads, layout.head_dim,
                         device=device, dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)

    # A finished request: 50 pages of prompt KV sit at scattered slots.
    tokens = torch.randint(0, 32000, (50 * layout.page_size,)).tolist()
    keys = page_keys(tokens, layout.page_size)
    slots = torch.randperm(num_slots, device=device)[:len(keys) * layout.page_size]

    with tempfile.TemporaryDirectory() as tmp:
        config = TierConfig.from_env(directories=(args.dir or tmp,), capacity="1GiB")
        with Tier(layout, config, device=device) as tier:
            stored = tier.put(keys, (k_pool, v_pool), slots)
            print(f"spilled {sum(stored)}/{len(keys)} pages")

            # A new request with the same prompt: how much can be restored, and where to.
            hit = tier.match_prefix(keys)
            new_slots = torch.randperm(num_slots, device=device)[:hit * layout.page_size]
            before = k_pool[:, slots[:hit * layout.page_size]].clone()
            k_pool.zero_()
            v_pool.zero_()
            restored = tier.get(keys[:hit], (k_pool, v_pool), new_slots)
            same = torch.equal(k_pool[:, new_slots], before)
            print(f"restored {sum(restored)}/{hit} pages into new slots, bit-exact: {same}")

            s = tier.stats()
            print(json.dumps({k: s[k] for k in ("backend", "backend_selected_because",
                                                "gpu_direct", "o_direct", "write_gbps",
                                                "read_gbps")}, indent=2))


if __name__ == "__main__":
    main()
