"""Probe (issue 49): is the suffix's attention over a long cache held back by too few thread
blocks? torch's flash kernel as ttft.py calls it (16 queries, 32 query heads over 8 KV heads:
few blocks) against the same attention split along the keys, flash-decoding style (chunks of
the prefix in one batched flash call, their log-sum-exps merged in fp32, the last keys and the
suffix's own causal part as a matmul). 32 layers' worth, Llama-3-8B heads, each timed as one
CUDA graph replay; ``maxerr`` is the split's largest difference to flash on one layer. The same
call on sdpa's cuDNN and memory-efficient backends, and torch's ``flex_attention`` (``--others``).

    python bench/experiments/split_attention_probe.py --tokens 2k,8k,32k,128k --json out.json

Answer on the H100: no below 128k. Flash took 0.56 / 1.38 / 4.19 / 16.3 ms at 2k / 8k / 32k /
128k; the best split 2.75 / 3.21 / 4.43 / 10.2 ms (its merge costs more than it saves until
128k). flex_attention 0.74 / 1.30 / 3.32 ms at 2k / 8k / 32k (0.8 ms less than flash at 32k),
cuDNN 1.98 / 5.88 / 21.4 ms. ttft.py keeps flash.
Results it produced: ``h100-2026-11-27/ttft-final/`` (call 1), ``h100-2026-11-27/ttft-disk/``
(call 6, ``--others``).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import ttft


def split_attention(query, key, value, scaling, chunk):
    """Attention of the last Lq positions over Lk keys, causal from the lower right."""
    b, hq, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    g = hq // hkv
    prefix = lk - lq
    s = max(1, prefix // chunk)
    c = prefix // s
    q = query.reshape(b, hkv, g * lq, d)  # non-causal over the prefix: heads fold into rows
    kp = key[0, :, :s * c].reshape(hkv, s, c, d).transpose(0, 1)
    vp = value[0, :, :s * c].reshape(hkv, s, c, d).transpose(0, 1)
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q.expand(s, hkv, g * lq, d), kp, vp, 0.0, False, False, scale=scaling)
    o, lse = out[0].float(), out[1]  # [s, hkv, g*lq, d], [s, hkv, g*lq]
    # tail: the prefix's leftover keys and the suffix itself, causal from the lower right
    kt, vt = key[:, :, s * c:], value[:, :, s * c:]
    lt = kt.shape[2]
    scores = torch.matmul(q.float(), kt.float().transpose(2, 3)) * scaling
    token = torch.arange(g * lq, device=query.device) % lq
    allowed = torch.arange(lt, device=query.device)[None, :] <= (lt - lq + token)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse_t = torch.logsumexp(scores, dim=-1)  # [1, hkv, g*lq]
    o_t = torch.matmul(torch.softmax(scores, dim=-1), vt.float())
    lse_all = torch.cat([lse, lse_t], 0)
    w = torch.softmax(lse_all, dim=0)  # [s+1, hkv, rows]
    merged = (w[:s, ..., None] * o).sum(0) + w[s, ..., None] * o_t[0]
    return merged.to(query.dtype).reshape(b, hq, lq, d)


def backend_attention(backend):
    """ttft.py's flash call (lower-right causal bias, grouped KV heads) restricted to one other
    sdpa backend (``CUDNN_ATTENTION``, ``EFFICIENT_ATTENTION``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = getattr(SDPBackend, backend)

    def attend(query, key, value, scaling):
        with sdpa_kernel(chosen):
            return ttft._flash_attention(query, key, value, scaling)
    return attend


def flex_attention_for(lq, lk, device):
    """torch's flex_attention (compiled; for short queries it runs its key-split decoding
    kernel) with a lower-right causal block mask and grouped KV heads."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    offset = lk - lq

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset
    mask = create_block_mask(causal, B=None, H=None, Q_LEN=lq, KV_LEN=lk, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(query, key, value, scaling):
        return compiled(query, key, value, block_mask=mask, scale=scaling, enable_gqa=True)
    return attend


def timed(fn, reps=20):
    """Median ms of ``fn`` replayed as one CUDA graph (captured after two warm-up runs on a
    side stream)."""
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); g.replay(); torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=ttft.parse_tokens, default=[2048, 8192, 32768, 131072])
    ap.add_argument("--chunks", default="512,1024,2048,4096")
    ap.add_argument("--others", default="cudnn,efficient,flex",
                    help="other attentions timed against flash: cudnn, efficient, flex")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    layers, hq, hkv, d, lq = 32, 32, 8, 128, 16
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for n in args.tokens:
        torch.manual_seed(n)
        ks = [torch.randn(1, hkv, n, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        vs = [torch.randn(1, hkv, n, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
        q = torch.randn(1, hq, lq, d, device=dev, dtype=torch.bfloat16)
        row = {"tokens": n}
        ref = ttft._flash_attention(q, ks[0], vs[0], d ** -0.5)
        row["flash_ms"] = timed(lambda: [ttft._flash_attention(q, k, v, d ** -0.5) for k, v in zip(ks, vs)])
        others = {"cudnn": lambda: backend_attention("CUDNN_ATTENTION"),
                  "efficient": lambda: backend_attention("EFFICIENT_ATTENTION"),
                  "flex": lambda: flex_attention_for(lq, n, dev)}
        for name in args.others.split(",") if args.others else []:
            try:
                attend = others[name]()
                got = attend(q, ks[0], vs[0], d ** -0.5)
                row[f"{name}_maxerr"] = (got.float() - ref.float()).abs().max().item()
                row[f"{name}_ms"] = timed(lambda: [attend(q, k, v, d ** -0.5)
                                                   for k, v in zip(ks, vs)])
            except Exception as exc:  # noqa: BLE001 - a backend that cannot take this call
                row[f"{name}_error"] = repr(exc)[:300]
        for c in map(int, args.chunks.split(",")) if args.chunks else []:
            got = split_attention(q, ks[0], vs[0], d ** -0.5, c)
            err = (got.float() - ref.float()).abs().max().item()
            row[f"split{c}_ms"] = timed(lambda: [split_attention(q, k, v, d ** -0.5, c) for k, v in zip(ks, vs)])
            row[f"split{c}_maxerr"] = err
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
        ks = vs = None  # (freed before the next N's)
        torch.cuda.empty_cache()
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
