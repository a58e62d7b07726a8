"""Time to first token with a real model (issue 49): a prompt's KV restored from gdskv against
its prefill recomputed.

The model is a Llama-3-8B-shaped transformers model with random weights (``LlamaConfig``, built
on the GPU, nothing downloaded; ``--tiny``: the 2-layer model of the example, for the CPU), or
with ``--model deepseek-v2-lite`` a DeepSeek-V2-Lite-shaped one (multi-head latent attention: its
cache keeps a KV latent and a rotary key a layer, which the example hands to gdskv in column
blocks; mixture of experts; ``--tiny``: the example's 2-layer one). For
each prompt length N (``--tokens``) and store directory (``--dirs``), every path ends with the
first token's logits (``logits_to_keep=1``) and a device sync:

  prefill            the N tokens prefilled on an empty cache;
  restore            the whole pages of the first N-1 tokens restored by
                     examples/transformers_prefix_cache.py (straight into new cache tensors, no
                     copy), the last 1..page_size tokens prefilled;
  restore_graph      the same pages restored straight into a transformers ``StaticCache`` of
                     exactly N tokens (``restore_static``: no copy), the last tokens' forward
                     replayed as a CUDA graph captured for this N before the timing
                     (``SuffixForward``; its capture is ``graph_capture_ms``), after one
                     untimed whole restore (``warm_restore_ms``: the tier's kernels compiled
                     and captured for this shape). TTFT = the restore, the copy of the suffix's
                     ids into the graph's inputs and the replay. The forward's attention is
                     ``--suffix-attention``'s first (default ``flash``: torch's flash kernel,
                     causal from the lower right, KV heads grouped, as an engine attends a
                     short query over a long cache; ``mask``: transformers' own sdpa path with
                     a 4-D mask); the others' suffix times are measured on the same restored
                     cache. On the CPU: no graph; the restore and the same forward run eagerly
                     are checked, and the path is reported skipped;
  restore_pool_copy  the same pages restored into a token-major pool ([layers, tokens, heads,
                     head_dim], an engine's layout), then copied into the cache: the copy the
                     other path avoids (not with --quick unless --paths names it);
  hit90, hit50       90 % / 50 % of the prompt's pages restored, the rest prefilled.

``--paths`` picks the restore paths to run (the prefill always runs). Each restore path reports
``restore_ms`` (to a usable cache), ``restore_io_ms`` (gdskv's ``get`` alone, device synced
around it) and ``suffix_ms`` (the forward of the tokens left).

After the model is built and warmed up the garbage collector's heap is frozen (``gc.freeze``),
as SGLang and vLLM do once their model is loaded. The page cache is dropped before every
restore (fadvise on the slab files, and /proc/sys/vm/drop_caches when root; the JSON says what
worked). Per N and directory also: the spill's time; raw kvikio reading the very slab extents
the restore read (same files, same process, kvikio's settings as the tier set them), once
right after the spill (``raw_kvikio_first``: on /dev/shm the first read of freshly written
pages is the slowest, for raw and gdskv alike) and once after the restores (``raw_kvikio``,
the ratio's base: a later read, as the timed restores are); and a decode of another request
(64 steps after a 2k-token cache) timed alone and while the N-token prefix is spilled over and
over on the tier's workers (``put_async``): the decode slowdown, of an eager loop (``decode``)
and, on a GPU, of the same steps replayed as CUDA graphs, as an engine decodes
(``decode.graph``, column "dec graph").

Correctness, every run: the restored KV bit-identical to the prefill's (``torch.equal`` per
layer), and the suffix's logits on the restored cache bit-identical to the same suffix on the
prefill's own cache cut to the restored length. The difference to the full prefill's logits is
reported apart: it runs other kernels, so it may differ in the last bits (issue 49).
``restore_graph`` is checked against its own reference: the same forward launched eagerly on the
same ``StaticCache`` holding the prefill's own KV. Exit status 1 if a check fails or a run fails
other than by running out of GPU memory (recorded, and the next N tried).

Results it produced: ``h100-2026-11-27/ttft/`` (the H100 run of issue 49),
``h100-2026-11-27/ttft-graph/`` (the graph path), ``h100-2026-11-27/ttft-restore/`` (the
suffix's attention, the warm restore) and ``h100-2026-11-27/ttft-final/`` (the final runs, the
graph-replayed decode); docs/ttft.md reads them.

    python bench/experiments/ttft.py --dirs /dev/shm/gdskv,/var/tmp/gdskv \\
        --json ttft.json --plot ttft.png    # minutes: split --tokens over calls if time is short
    python bench/experiments/ttft.py --quick --dirs /dev/shm/gdskv --json quick.json
    python bench/experiments/ttft.py --paths restore,restore_graph --no-decode \\
        --tokens 1k,2k,8k,32k --dirs /dev/shm/gdskv --json graph.json   # two paths only
    python bench/experiments/ttft.py --device cpu --tiny --tokens 64,128 --dirs /tmp/ttft
    python bench/experiments/ttft.py --from-json ttft.json --plot ttft.png   # table and plot again
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import torch

from experiment_helpers import REPO
from gdskv.backends.memory_files import wait_registered
from gdskv.bench.cache import drop_page_cache, fs_type
from gdskv.config import TierConfig

FULL_TOKENS = (1024, 2048, 8192, 32768, 65536, 131072)
QUICK_TOKENS = (2048, 8192)
#: prompts longer than this are prefilled once, and their paths that prefill once a sample
#: (each sample of a 128k prefill takes seconds); ``restore_graph`` takes --repeat samples
REPEAT_UP_TO = 32768
#: the restore paths, in the order they run (the prefill always runs: every path is checked
#: against its KV and its TTFT is every speedup's base)
RESTORE_PATHS = ("restore", "restore_graph", "hit90", "hit50", "restore_pool_copy")


def parse_tokens(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        try:
            n = int(part[:-1] if mult > 1 else part) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"--tokens: {part!r} is not a count (e.g. 2k,8192)")
        if n < 2:
            raise argparse.ArgumentTypeError(f"--tokens: {n} is under 2 tokens")
        out.append(n)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn):
    """``(fn(), seconds)`` with the device idle before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def example():
    """examples/transformers_prefix_cache.py: the code a user copies is the code measured."""
    folder = os.path.join(REPO, "examples")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import transformers_prefix_cache
    return transformers_prefix_cache


def llama3_8b(device, max_tokens: int):
    """Llama-3-8B's shape with random weights, built where it runs (built on the CPU first it
    took minutes), bf16, sdpa attention."""
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=max(131072, max_tokens), rms_norm_eps=1e-5,
        tie_word_embeddings=False)
    return example().random_model(config, device, torch.bfloat16, attn_implementation="sdpa")


def deepseek_v2_lite(device, max_tokens: int):
    """DeepSeek-V2-Lite's shape (27 layers, multi-head latent attention with a 512-wide KV
    latent and a 64-wide rotary key cached a layer, 64 routed experts of which 6 a token, 2
    shared, the first layer dense) with random weights, built where it runs, bf16, sdpa
    attention; rotary embeddings without the released model's YaRN scaling."""
    import transformers
    config = transformers.DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1,
        max_position_embeddings=max(163840, max_tokens), rms_norm_eps=1e-6,
        tie_word_embeddings=False)
    return example().random_model(config, device, torch.bfloat16, attn_implementation="sdpa")


#: --model: the random-weight models the bench builds (the tiny ones with --tiny)
MODELS = {"llama3-8b": ("llama3-8b-shape-random", llama3_8b, "tiny_llama",
                        "tiny-llama-2-layer"),
          "deepseek-v2-lite": ("deepseek-v2-lite-shape-random", deepseek_v2_lite,
                               "tiny_deepseek", "tiny-deepseek-v2-2-layer")}


def medium(path: str) -> dict:
    """What a store directory sits on: file system type and block device (None for RAM)."""
    st = os.stat(path)
    dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    block = os.path.basename(os.path.realpath(dev)) if os.path.exists(dev) else None
    return {"dir": path, "fs_type": fs_type(path), "block_device": block}


def slab_files(store: str) -> list[str]:
    return sorted(os.path.join(store, f) for f in os.listdir(store)
                  if f.startswith("slab-") and f.endswith(".bin"))


def tier_config(args, store: str, slot_bytes: int, pages: int) -> TierConfig:
    """The environment's GDSKV_* settings, with this run's directory, backend and a capacity
    that holds ``pages`` (plus the stripes lost to rounding: the store uses whole stripes, the
    same number per slab file)."""
    base = TierConfig.from_env(directories=(store,), backend=args.backend)
    if args.tiny:  # a few KiB a page: small stripes and staging
        base = base.replace(io_chunk_size=1 << 20, staging_size=8 << 20)
    stripe = max(1, base.io_chunk_size // slot_bytes) * slot_bytes
    extra = 2 * base.files_per_dir * len(base.directories) * stripe
    return base.replace(capacity=pages * slot_bytes + extra)


def backend_choice(device: torch.device) -> tuple[str, str]:
    if device.type != "cuda":
        return "posix", "CPU run: kvikio needs a CUDA device"
    try:
        import kvikio  # noqa: F401
    except ImportError as exc:
        return "posix", f"kvikio not importable ({exc})"
    return "kvikio", "kvikio importable and a CUDA device"


class Run:
    """One N: the prompt, its prefill, the references every restore is checked against."""

    def __init__(self, args, ex, model, n: int) -> None:
        self.args, self.ex, self.model, self.n = args, ex, model, n
        self.device = args.device
        page = args.page_size
        g = torch.Generator().manual_seed(n)
        self.ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(self.device)
        self.keys, hash_s = timed(torch.device("cpu"), lambda: ex.page_keys(self.ids, page))
        self.hash_ms = hash_s * 1e3
        self.repeats = args.repeat if n <= REPEAT_UP_TO else 1
        samples = []
        self.cache = None
        for _ in range(self.repeats):
            self.cache = None
            (self.logits, self.cache), s = timed(self.device, lambda: ex.forward(model, self.ids))
            samples.append(s * 1e3)
        self.prefill = {"ttft_ms": statistics.median(samples), "samples_ms": samples}
        # pages restorable with one token left to prefill
        self.whole = whole = (n - 1) // page
        self.hits: dict[str, int] = {}
        self.refs: dict[int, torch.Tensor | dict] = {}
        if whole == 0:
            return  # no whole page before the last token: nothing to restore
        fractions = {"hit90": 0.9, "hit50": 0.5}
        for name in (p for p in RESTORE_PATHS if p in args.paths):
            self.hits[name] = (max(1, min(whole, round(fractions[name] * len(self.keys))))
                               if name in fractions else whole)
        # the references, before any restore: the suffix's logits on the prefill's own cache
        # cut to each restored length (one at a time: each costs a cache's worth of memory;
        # restore_graph makes its own, on its StaticCache)
        for pages in sorted({p for name, p in self.hits.items() if name != "restore_graph"}):
            self.refs[pages] = guarded(lambda: self._reference(pages))

    def _reference(self, pages: int) -> torch.Tensor:
        t = pages * self.args.page_size
        cut = self.ex.cache_from([layer.keys[..., :t, :] for layer in self.cache.layers],
                                 [layer.values[..., :t, :] for layer in self.cache.layers])
        return self.ex.forward(self.model, self.ids[:, t:], cut)[0]

    def unchecked(self, pages: int) -> dict | None:
        """Why a restore of ``pages`` pages cannot be checked (its reference failed), or None."""
        ref = self.refs[pages]
        return {k: f"reference: {v}" for k, v in ref.items()} if isinstance(ref, dict) else None

    def checks(self, cache, logits: torch.Tensor, pages: int,
               reference: torch.Tensor | None = None) -> dict:
        """The cache's first ``pages`` pages against the prefill's KV, and ``logits`` against
        ``reference`` (default: the suffix on the prefill's own cache cut to those pages)."""
        t = pages * self.args.page_size
        kv = all(torch.equal(a.keys[..., :t, :], b.keys[..., :t, :]) and
                 torch.equal(a.values[..., :t, :], b.values[..., :t, :])
                 for a, b in zip(cache.layers, self.cache.layers))
        reference = self.refs[pages] if reference is None else reference
        out = {"bit_exact_kv": kv, "bit_exact_logits": torch.equal(logits, reference)}
        if not out["bit_exact_logits"]:
            out["max_abs_logit_diff"] = max_diff(logits, reference)
        diff = max_diff(logits, self.logits)
        out["vs_full_prefill"] = {"max_abs_logit_diff": diff,
                                  "same_argmax": bool(logits.argmax() == self.logits.argmax())}
        return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


#: how the suffix's forward attends over the cache (``--suffix-attention``): ``mask``,
#: transformers' own sdpa path with a 4-D mask over the whole StaticCache (it repeats each KV
#: head for its query heads and runs a masked kernel with one block of queries a head, so its
#: cost grows with N); ``grouped``, the query heads of each KV head as one matrix against that
#: head's keys (no repeated KV, softmax in fp32, as transformers' eager attention); ``flash``,
#: torch's sdpa flash kernel with a lower-right causal mask and grouped KV heads (an engine's
#: short-query-over-long-cache attention). ``grouped`` and ``flash`` need a cache that holds
#: exactly the prompt (its last ``length`` positions are the suffix)
SUFFIX_ATTENTIONS = ("mask", "grouped", "flash")


def _grouped_attention(query, key, value, scaling):
    """Attention of the last ``Lq`` positions over all ``Lk`` keys, causal from the lower
    right: query ``[1, Hq, Lq, d]``, key/value ``[1, Hkv, Lk, d]``; ``[1, Hq, Lq, d]``."""
    b, hq, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    q = query.reshape(b, hkv, hq // hkv * lq, d)  # rows: query head within its group, token
    scores = torch.matmul(q, key.transpose(2, 3)) * scaling
    token = torch.arange(hq // hkv * lq, device=query.device) % lq
    allowed = torch.arange(lk, device=query.device)[None, :] <= (lk - lq + token)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).reshape(b, hq, lq, value.shape[-1])


def _flash_attention(query, key, value, scaling):
    from torch.nn.attention.bias import causal_lower_right
    bias = causal_lower_right(query.shape[2], key.shape[2])
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, scale=scaling, enable_gqa=True)


def _attention_for_transformers(kernel):
    """``kernel`` as a transformers attention function (its ``AttentionInterface``)."""
    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return kernel(query, key, value, scale).transpose(1, 2).contiguous(), None
    return attend


@functools.lru_cache(maxsize=None)
def registered_attention(kind: str) -> str:
    """The transformers attention implementation name for ``kind`` (registered once). A name
    transformers has no mask function for makes its mask code step aside (no mask is made):
    the function masks by itself."""
    if kind == "mask":
        return "sdpa"
    import transformers
    name = f"gdskv_suffix_{kind}"
    kernel = {"grouped": _grouped_attention, "flash": _flash_attention}[kind]
    transformers.AttentionInterface.register(name, _attention_for_transformers(kernel))
    return name


class SuffixForward:
    """``length`` tokens' forward over ``cache`` (a ``StaticCache`` with its tensors made) to
    the last token's logits; ``cache_argument``: what the model's ``forward`` calls the cache;
    ``attention``: one of ``SUFFIX_ATTENTIONS``.

    Everything that changes between CUDA graph replays lives in tensors filled before each
    (``set``): the suffix's ids, and its start position (the tokens already in the cache), from
    which the captured forward derives the position ids, each layer's write position
    (``StaticCache``'s ``cumulative_length``) and, for ``mask``, the causal mask. The mask is
    made here, a 4-D boolean tensor (``True``: attend) that transformers passes through: its
    own mask code compares the cache's length (a device tensor in a ``StaticCache``) with 0 in
    Python, a read back to the host, and no host read may happen during a capture. ``grouped``
    and ``flash`` take no mask: the suffix is the cache's last ``length`` positions. ``eager()``
    runs the very same calls without a graph: the reference a replay must equal bit for bit."""

    def __init__(self, model, cache, length: int, cache_argument: str,
                 attention: str = "mask") -> None:
        self.model, self.cache, self.cache_argument = model, cache, cache_argument
        if attention not in SUFFIX_ATTENTIONS:
            raise ValueError(f"SuffixForward: attention {attention!r} is not one of "
                             f"{', '.join(SUFFIX_ATTENTIONS)}")
        self.attention = attention
        self._implementation = registered_attention(attention)
        first = cache.layers[0]
        if not getattr(first, "is_initialized", False):
            raise ValueError("SuffixForward: the StaticCache has no tensors yet")
        device, self.capacity = first.keys.device, first.max_cache_len
        if not 1 <= length <= self.capacity:
            raise ValueError(f"SuffixForward: length {length} is not in 1..{self.capacity} "
                             "(the cache's max_cache_len)")
        self.length = length
        self.ids = torch.zeros(1, length, dtype=torch.long, device=device)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self._offsets = torch.arange(length, device=device)
        self._kv_positions = torch.arange(self.capacity, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None

    def set(self, ids: torch.Tensor, start: int) -> None:
        """The next forward's inputs: ``ids`` (``[1, length]``, on the cache's device) at
        positions ``start ..``. Two kernels, no host-to-device copy."""
        if ids.shape != self.ids.shape:
            raise ValueError(f"SuffixForward.set: ids of shape {tuple(ids.shape)}, the graph "
                             f"takes {tuple(self.ids.shape)}")
        if not 0 <= start <= self.capacity - self.length:
            raise ValueError(f"SuffixForward.set: start {start} leaves no room for "
                             f"{self.length} tokens in {self.capacity}")
        if self.attention != "mask" and start != self.capacity - self.length:
            raise ValueError(f"SuffixForward.set: {self.attention} attention takes the "
                             f"suffix as the cache's last {self.length} of {self.capacity} "
                             f"positions (start {self.capacity - self.length}), not {start}")
        self.ids.copy_(ids)
        self.start.fill_(start)

    def _forward(self) -> torch.Tensor:
        positions = (self._offsets + self.start).unsqueeze(0)
        for layer in self.cache.layers:  # where each layer's update writes this suffix's KV
            layer.cumulative_length.copy_(self.start)
        mask = None
        if self.attention == "mask":
            mask = (self._kv_positions[None, :] <= positions[0, :, None])[None, None]
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = self._implementation  # this forward's only
        try:
            out = self.model(input_ids=self.ids, position_ids=positions, attention_mask=mask,
                             use_cache=True, logits_to_keep=1,
                             **{self.cache_argument: self.cache})
        finally:
            config._attn_implementation = before
        return out.logits[:, -1]

    def eager(self) -> torch.Tensor:
        """The forward of the current inputs, launched kernel by kernel (no graph)."""
        return self._forward()

    def capture(self, warmup: int = 2) -> None:
        """Record the forward as a CUDA graph (after ``warmup`` eager runs on a side stream, as
        PyTorch asks: lazy initialisations and library handles happen outside the capture).
        The cache's positions ``start ..`` are written by each run: call after ``set`` with
        positions the next restore overwrites anyway."""
        stream = torch.cuda.Stream(self.ids.device)
        stream.wait_stream(torch.cuda.current_stream(self.ids.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self._forward()
        torch.cuda.current_stream(self.ids.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the tier's worker threads may touch CUDA while this thread captures
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self._forward()
        self.graph, self._logits = graph, logits

    def replay(self) -> torch.Tensor:
        """The captured forward on the current inputs: the logits' tensor (the graph's own, so
        overwritten by the next replay; not synchronised)."""
        if self.graph is None:
            raise RuntimeError("SuffixForward.replay: capture() first")
        self.graph.replay()
        return self._logits


def drop(paths: list[str], args) -> str:
    """Drop the page cache of the slab files (and the machine's, unless --drop-caches files)."""
    return drop_page_cache(paths, machine_wide=args.drop_caches == "machine")["summary"]


@contextlib.contextmanager
def timing_gets(tier, device):
    """Time each ``tier.get`` inside the block alone, the device idle before and after (the
    gdskv read without the lookup, allocation and cache bookkeeping around it): the list of
    seconds it yields fills as the calls return."""
    seconds: list[float] = []
    get = tier.get

    def timed_get(*args, **kwargs):
        hits, s = timed(device, lambda: get(*args, **kwargs))
        seconds.append(s)
        return hits
    tier.get = timed_get  # this instance only; the class's method is back after the block
    try:
        yield seconds
    finally:
        del tier.get


def restore_path(run: Run, pc, pages: int, store: str) -> dict:
    """TTFT through the example's PrefixCache.restore (gdskv scatters into the cache's own
    tensors) and a prefill of the rest."""
    samples, cache, logits, tokens = [], None, None, 0
    for _ in range(run.repeats):
        cache = logits = None
        dropped = drop(slab_files(store), run.args)
        with timing_gets(pc.tier, run.device) as io:
            sync(run.device)
            t0 = time.perf_counter()
            cache, tokens = pc.restore(run.keys[:pages])
            sync(run.device)
        t1 = time.perf_counter()
        logits, cache = run.ex.forward(run.model, run.ids[:, tokens:], cache)
        sync(run.device)
        samples.append({"restore": t1 - t0, "io": sum(io),
                        "suffix": time.perf_counter() - t1})
    if tokens != pages * run.args.page_size:
        return {"error": f"restored {tokens} tokens of {pages * run.args.page_size}"}
    return {**summary(samples, pages, pc.layout.slot_bytes, run), "page_cache": dropped,
            **run.checks(cache, logits, pages)}


def restore_graph_path(run: Run, pc, store: str) -> dict:
    """TTFT through the example's PrefixCache.restore_static (gdskv scatters into a
    StaticCache's own tensors) and the suffix's forward replayed as a CUDA graph; on the CPU the
    same restore and forward run eagerly, checked but reported skipped. The TTFT uses the first
    of ``--suffix-attention``; each other one's suffix is timed on the same restored cache
    (``suffix_attention``), each checked against its own eager run on the prefill's KV."""
    dev, pages = run.device, run.whole
    t = pages * run.args.page_size
    cache = run.ex.static_cache(run.model, run.n)  # exactly the prompt: its last tokens prefilled
    forwards = {kind: SuffixForward(run.model, cache, run.n - t,
                                    run.ex.cache_argument(type(run.model)), kind)
                for kind in run.args.suffix_attention}
    suffix = run.ids[:, t:]
    # the references: the prefill's own KV in this very cache, each forward run eagerly
    for mine, theirs in zip(cache.layers, run.cache.layers):
        mine.keys[..., :t, :].copy_(theirs.keys[..., :t, :])
        mine.values[..., :t, :].copy_(theirs.values[..., :t, :])
    references = {}
    for kind, forward in forwards.items():
        forward.set(suffix, t)
        references[kind] = forward.eager().clone()
    out: dict = {"max_cache_len": run.n, "attention": run.args.suffix_attention[0]}
    # warm: the first restore of this pool and chunk shape compiles and captures the tier's
    # kernels (hundreds of ms on a fresh machine: a one-time cost, not a TTFT's). Recorded
    _, s = timed(dev, lambda: pc.restore_static(run.keys[:pages], cache))
    out["warm_restore_ms"] = s * 1e3
    if dev.type == "cuda":
        out["graph_capture_ms"], out["graph_vs_eager"] = {}, {}
        for kind, forward in forwards.items():
            forward.set(suffix, t)
            try:
                _, s = timed(dev, forward.capture)
            except Exception as exc:  # noqa: BLE001 - recorded; the other paths go on
                return {**out, "error": f"CUDA graph capture ({kind}) failed: {exc!r}"[:500],
                        "traceback": traceback.format_exc()[-2000:]}
            out["graph_capture_ms"][kind] = s * 1e3  # its 2 eager warm-up runs included
            # the cache still holds the prefill's KV: the replay must equal the eager run
            replayed = forward.replay().clone()
            out["graph_vs_eager"][kind] = {
                "bit_exact": torch.equal(replayed, references[kind]),
                "max_abs_logit_diff": max_diff(replayed, references[kind])}
    else:
        out["skipped"] = "no CUDA device (restore + eager suffix checked)"
    first = forwards[run.args.suffix_attention[0]]
    run_suffix = first.replay if first.graph is not None else first.eager
    samples, logits, tokens, raw = [], None, 0, []
    for _ in range(run.args.repeat):  # (every N: a sample costs a restore and a replay)
        # raw kvikio's read of the same extents just before each restore: the ratio then
        # compares reads made in the same state of the machine (its reads drift within a call)
        raw.append(raw_kvikio(pc.tier, run.keys[:pages], run.args) if dev.type == "cuda"
                   and pc.tier.stats()["backend"] == "kvikio" else {})
        for layer in cache.layers:  # untimed: the restore alone must put the prefix back
            layer.keys.zero_()
            layer.values.zero_()
        dropped = drop(slab_files(store), run.args)
        with timing_gets(pc.tier, dev) as io:
            sync(dev)
            t0 = time.perf_counter()
            tokens = pc.restore_static(run.keys[:pages], cache)
            sync(dev)
        t1 = time.perf_counter()
        first.set(suffix, t)
        sync(dev)
        t2 = time.perf_counter()
        logits = run_suffix()
        sync(dev)
        samples.append({"restore": t1 - t0, "io": sum(io), "copy_in": t2 - t1,
                        "suffix": time.perf_counter() - t2})
    if tokens != t:
        return {**out, "error": f"restored {tokens} tokens of {t}"}
    logits = logits.clone()  # (a replay's output tensor is the graph's: the next one overwrites)
    out["suffix_attention"] = {}
    for kind, forward in forwards.items():  # each attention's suffix on the restored cache
        again = forward.replay if forward.graph is not None else forward.eager
        times, got = [], None
        for _ in range(max(3, run.repeats)):
            forward.set(suffix, t)
            got, s = timed(dev, again)
            times.append(s * 1e3)
        out["suffix_attention"][kind] = {
            "suffix_ms": statistics.median(times),
            "bit_exact_logits": torch.equal(got, references[kind]),
            "max_abs_logit_diff_vs_mask": (max_diff(got, references["mask"])
                                           if "mask" in references else None)}
    times = summary(samples, pages, pc.layout.slot_bytes, run)
    if all("ms" in r for r in raw):
        ms = statistics.median(r["ms"] for r in raw)
        out["raw_alternating"] = {"ms": ms, "gbps": raw[0]["bytes"] / ms / 1e6,
                                  "samples_ms": [r["ms"] for r in raw]}
    if "skipped" in out:  # eager timings on the CPU: not this path's, kept apart
        times["eager_ttft_ms"] = times.pop("ttft_ms")
        del times["speedup"]
    return {**times, "page_cache": dropped, **out,
            **run.checks(cache, logits, pages, references[run.args.suffix_attention[0]])}


def summary(samples: list[dict], pages: int, slot_bytes: int, run: Run) -> dict:
    """Medians of the samples' parts (seconds: ``restore`` to a usable cache, of which ``io``
    is gdskv's read; ``copy_in`` of a graph's inputs; ``suffix``, the rest's forward)."""
    def median_ms(part: str) -> float:
        return statistics.median(s[part] for s in samples) * 1e3
    restore_s = median_ms("restore") / 1e3
    ttft = [(s["restore"] + s.get("copy_in", 0.0) + s["suffix"]) * 1e3 for s in samples]
    nbytes = pages * slot_bytes
    out = {"pages": pages, "restored_tokens": pages * run.args.page_size,
           "prefilled_tokens": run.n - pages * run.args.page_size,
           "ttft_ms": statistics.median(ttft), "samples_ms": ttft,
           "restore_ms": restore_s * 1e3, "suffix_ms": median_ms("suffix"),
           "speedup": run.prefill["ttft_ms"] / statistics.median(ttft),
           "bytes": nbytes, "restore_gbps": nbytes / restore_s / 1e9}
    for part in ("io", "copy_in"):
        if all(part in s for s in samples):
            out[f"{'restore_io' if part == 'io' else part}_ms"] = median_ms(part)
    return out


def spill(run: Run, pc) -> dict:
    stored, s = timed(run.device, lambda: pc.spill(run.keys, run.cache))
    nbytes = len(run.keys) * pc.layout.slot_bytes
    if stored != len(run.keys):
        raise RuntimeError(f"spill stored {stored} of {len(run.keys)} pages")
    return {"ms": s * 1e3, "gbps": nbytes / s / 1e9, "pages": stored}


def raw_kvikio(tier, keys: list[str], args) -> dict:
    """kvikio ``pread`` of the slab extents holding ``keys`` into one GPU buffer, all at once."""
    if tier.stats()["backend"] != "kvikio":
        return {"skipped": f"backend is {tier.stats()['backend']}, not kvikio"}
    import kvikio
    handles = tier.pin(keys)
    try:  # where the pages are (the store's own mapping: these are the bytes get() reads)
        extents = tier.store.extents(handles)
        paths = [f.path for f in tier.store.files]
    finally:
        tier.unpin(handles)
    nbytes = sum(e.length for e in extents)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=tier.device)
    files = {i: kvikio.CuFile(paths[i], "r") for i in sorted({e.file for e in extents})}
    try:
        dropped = drop(paths, args)
        sync(tier.device)
        t0 = time.perf_counter()
        futures = [files[e.file].pread(buf[e.buffer_offset:e.buffer_offset + e.length],
                                       file_offset=e.file_offset) for e in extents]
        got = sum(f.get() for f in futures)
        sync(tier.device)
        s = time.perf_counter() - t0
    finally:
        for f in files.values():
            f.close()
    if got != nbytes:
        raise RuntimeError(f"raw kvikio read {got} of {nbytes} bytes")
    return {"gbps": nbytes / s / 1e9, "ms": s * 1e3, "bytes": nbytes, "extents": len(extents),
            "page_cache": dropped}


class Decoder:
    """Another request: a cache of ``context`` tokens, then ``steps`` greedy one-token steps."""

    def __init__(self, ex, model, context: int, steps: int, device) -> None:
        self.ex, self.model, self.steps, self.device = ex, model, steps, device
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, model.config.vocab_size, (1, context + 1), generator=g).to(device)
        _, cache = ex.forward(model, ids[:, :context])
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]
        self.first = ids[:, context:]
        self.loop()  # warm: the kernels of one-token steps

    def loop(self) -> float:
        cache = self.ex.cache_from(self.keys, self.values)  # (the first step copies, not edits)
        tok = self.first

        def steps():
            nonlocal cache, tok
            for _ in range(self.steps):
                logits, cache = self.ex.forward(self.model, tok, cache)
                tok = logits.argmax(-1, keepdim=True)
        return timed(self.device, steps)[1] * 1e3


class GraphDecoder:
    """The same request's decode as an engine runs it: each one-token step one CUDA graph replay
    (``SuffixForward`` of one token over a ``StaticCache`` of context + steps, ``mask``
    attention), the next token chosen on the GPU. Four launches a step where the eager loop
    makes hundreds, so what slows it during a spill is the GPU's own sharing, not host threads
    taking the interpreter lock from the loop. Every loop starts again from the same context
    (its steps overwrite the positions after it)."""

    def __init__(self, ex, model, decoder: Decoder) -> None:
        self.steps, self.device, self.first = decoder.steps, decoder.device, decoder.first
        self.context = decoder.keys[0].shape[-2]
        cache = ex.static_cache(model, self.context + self.steps)
        for layer, k, v in zip(cache.layers, decoder.keys, decoder.values):
            layer.keys[..., :self.context, :].copy_(k)
            layer.values[..., :self.context, :].copy_(v)
        self.forward = SuffixForward(model, cache, 1, ex.cache_argument(type(model)), "mask")
        self.forward.set(self.first, self.context)
        self.forward.capture()
        self.loop()  # warm

    def loop(self) -> float:
        def steps():
            tok = self.first
            for i in range(self.steps):
                self.forward.set(tok, self.context + i)
                tok = self.forward.replay().argmax(-1, keepdim=True)
        return timed(self.device, steps)[1] * 1e3


def decode_slowdown(run: Run, pc, decoder: Decoder, graph: GraphDecoder | None = None) -> dict:
    """The decode while this N's prefix is evicted and spilled again, over and over, by another
    thread through ``put_async`` (the tier's workers and stream), against the mean of the same
    decode alone just before and just after: the eager loop (top-level keys) and, where there
    is one, the graph-replayed loop (``graph``), each timed alone and during the spills."""
    loops = {"eager": decoder.loop} | ({"graph": graph.loop} if graph is not None else {})
    before = {name: loop() for name, loop in loops.items()}
    pool, slots = pc.pool([layer.keys for layer in run.cache.layers],
                          [layer.values for layer in run.cache.layers], len(run.keys))
    stop, started, spills, errors = threading.Event(), threading.Event(), [], []

    def spill_loop():
        try:
            while not stop.is_set():
                pc.tier.evict(run.keys)
                fut = pc.tier.put_async(run.keys, pool, slots)
                started.set()
                t0 = time.perf_counter()
                ok = sum(fut.result())
                spills.append((ok, time.perf_counter() - t0))
        except Exception as exc:  # noqa: BLE001 - reported with the result
            errors.append(repr(exc))
        finally:
            started.set()

    worker = threading.Thread(target=spill_loop, name="ttft-spill")
    worker.start()
    started.wait()
    try:
        during = {name: loop() for name, loop in loops.items()}
    finally:
        stop.set()
        worker.join()
    if errors:
        raise RuntimeError(f"spill during decode: {errors[0]}")
    after = {name: loop() for name, loop in loops.items()}

    def measured(name: str) -> dict:
        alone = (before[name] + after[name]) / 2
        return {"alone_ms": alone, "alone_before_after_ms": [before[name], after[name]],
                "during_spill_ms": during[name], "slowdown": during[name] / alone}
    out = {"steps": decoder.steps, **measured("eager"), "spills_finished": len(spills),
           "spill_ms_each": [round(s * 1e3, 2) for _, s in spills],
           "pages_each": [ok for ok, _ in spills]}
    if graph is not None:
        out["graph"] = measured("graph")
    return out


def restore_pool_copy(run: Run, args, store: str) -> dict:
    """The pages in a token-major layout: spilled from a copy of the cache in that layout,
    restored into a token-major pool and copied into new cache tensors."""
    from gdskv import KVLayout
    from gdskv.tier import Tier
    keys_part, values_part = run.ex.cache_parts(run.model.config)
    if keys_part != values_part:
        return {"skipped": "the cache's keys and values differ in width (MLA latents): no "
                           "token-major pool of K and V heads"}
    layers, heads, head_dim = run.ex.kv_geometry(run.model.config)
    page, dev = args.page_size, run.device
    layout = KVLayout(num_layers=layers, page_size=page, head_dim=head_dim, kv_heads=heads,
                      dtype=run.model.dtype, model_name="ttft-token-major")
    cfg = tier_config(args, store, layout.slot_bytes, len(run.keys))
    with Tier(layout, cfg, device=dev) as tier:
        def put():
            t = len(run.keys) * page
            pool = tuple(torch.stack([getattr(layer, part)[0, :, :t].transpose(0, 1)
                                      for layer in run.cache.layers])
                         for part in ("keys", "values"))
            return sum(tier.put(run.keys, pool, torch.arange(t, device=dev)))
        stored, spill_s = timed(dev, put)
        if stored != len(run.keys):
            raise RuntimeError(f"spill stored {stored} of {len(run.keys)} pages")
        pages = run.hits["restore_pool_copy"]
        t = pages * page
        samples, cache, logits = [], None, None
        for _ in range(run.repeats):
            cache = logits = None
            dropped = drop(slab_files(store), run.args)
            sync(dev)
            t0 = time.perf_counter()
            pool = tuple(torch.empty(layers, t, heads, head_dim, dtype=run.model.dtype,
                                     device=dev) for _ in range(2))
            hits = tier.get(run.keys[:pages], pool, torch.arange(t, device=dev))
            cache = run.ex.cache_from(*([part[i].transpose(0, 1).unsqueeze(0).contiguous()
                                         for i in range(layers)] for part in pool))
            del pool
            sync(dev)
            t1 = time.perf_counter()
            logits, cache = run.ex.forward(run.model, run.ids[:, t:], cache)
            sync(dev)
            samples.append({"restore": t1 - t0, "suffix": time.perf_counter() - t1})
            if not all(hits):
                return {"error": f"restored {sum(hits)} of {pages} pages"}
    return {**summary(samples, pages, layout.slot_bytes, run), "page_cache": dropped,
            "spill_ms": spill_s * 1e3, **run.checks(cache, logits, pages)}


def run_medium(run: Run, args, base: str, decoder: Decoder | None) -> dict:
    """Every restore path of one N from one store directory."""
    out: dict = {"tokens": run.n, "dir": base, "paths": {}}
    store = tempfile.mkdtemp(prefix="gdskv-ttft-", dir=base)
    try:
        layout = run.ex.cache_layout(run.model.config, args.page_size, run.model.dtype)
        cfg = tier_config(args, store, layout.slot_bytes, len(run.keys))
        with run.ex.PrefixCache(run.model.config, cfg, page_size=args.page_size,
                                dtype=run.model.dtype, device=run.device,
                                model_name="ttft-llama") as pc:
            stats = pc.tier.stats()
            out["backend"] = {k: stats[k] for k in ("backend", "gpu_direct", "o_direct",
                                                    "o_direct_reason", "backend_detail")}
            out["memory_files"] = wait_registered(pc.tier)
            out["spill"] = spill(run, pc)
            # the first read of the freshly written pages, by raw kvikio: on /dev/shm it takes
            # longer than any later read, for raw and gdskv alike (RESULTS.md, "Whole-page
            # staging parts"); every timed read below is a later one, the raw one included
            out["raw_kvikio_first"] = guarded(lambda: raw_kvikio(pc.tier, run.keys[:run.whole],
                                                                 args))
            pc.restore(run.keys[:1])  # warm: this pool shape's first call
            for name, pages in run.hits.items():
                if name == "restore_graph":
                    out["paths"][name] = guarded(lambda: restore_graph_path(run, pc, store))
                    free_memory()  # the StaticCache and the graph's own memory pool
                elif name != "restore_pool_copy":
                    out["paths"][name] = run.unchecked(pages) or guarded(
                        lambda: restore_path(run, pc, pages, store))
            whole = run.keys[:run.whole]
            out["raw_kvikio"] = guarded(lambda: raw_kvikio(pc.tier, whole, args))
            if decoder is not None:
                out["decode"] = guarded(lambda: decode_slowdown(run, pc, *decoder))
        shutil.rmtree(store)
        if "restore_pool_copy" in run.hits:
            store = tempfile.mkdtemp(prefix="gdskv-ttft-", dir=base)
            out["paths"]["restore_pool_copy"] = run.unchecked(run.hits["restore_pool_copy"]) or \
                guarded(lambda: restore_pool_copy(run, args, store))
    finally:
        shutil.rmtree(store, ignore_errors=True)
    raw = out.get("raw_kvikio", {}).get("gbps")
    for name, p in out["paths"].items():
        if "restore_gbps" in p and raw:
            p["restore_vs_raw"] = p["restore_gbps"] / raw
        if "restore_gbps" in p and "raw_alternating" in p:  # the better-matched base
            p["restore_vs_raw_alternating"] = p["restore_gbps"] / p["raw_alternating"]["gbps"]
    b = out["paths"].get("restore", {})
    if "suffix_ms" in b and run.prefill["ttft_ms"] > b["suffix_ms"]:
        # the restore bandwidth (everything before the suffix's prefill) at which TTFT would
        # equal the prefill's: docs/ttft.md
        headroom_s = (run.prefill["ttft_ms"] - b["suffix_ms"]) / 1e3
        out["break_even_gbps"] = b["bytes"] / headroom_s / 1e9
    g = out["paths"].get("restore_graph", {})
    if "ttft_ms" in g and run.prefill["ttft_ms"] > g["suffix_ms"] + g["copy_in_ms"]:
        headroom_s = (run.prefill["ttft_ms"] - g["suffix_ms"] - g["copy_in_ms"]) / 1e3
        g["break_even_gbps"] = g["bytes"] / headroom_s / 1e9
    return out


def guarded(fn):
    """``fn()``, or a dict of what stopped it: out of GPU memory (expected at the largest N) or
    an error."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        record = {"oom" if is_oom(exc) else "error": repr(exc)[:500]}
        if "error" in record:
            record["traceback"] = traceback.format_exc()[-2000:]
    free_memory()
    return record


def exact(path: dict) -> str:
    return "ok" if path["bit_exact_kv"] and path["bit_exact_logits"] else "FAIL"


def _num(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def table(result: dict) -> str:
    """The short table: a row per N x directory x path ("io ms": gdskv's read alone; "sfx ms":
    the forward of the tokens left; "need": the restore GB/s at which TTFT equals the
    prefill's, docs/ttft.md; "r/raw": the restore's GB/s over raw kvikio's, over its reads
    made just before each restore where the path has them: ``restore_graph``)."""
    cols = ("N", "medium", "path", "TTFT ms", "io ms", "sfx ms", "speedup", "GB/s", "raw",
            "r/raw", "need", "spill ms", "decode", "dec graph", "exact")
    rows = [[n, "-", "prefill", _num(p["ttft_ms"], ".1f"), "-", "-", "1.00x"] + ["-"] * 7
            + ["ref"]
            if "ttft_ms" in p else [n, "-", "prefill", "; ".join(f"{k}: {v}" for k, v in
                                                                p.items())[:70]]
            for n, p in result["prefill"].items()]
    for m in result["runs"]:
        where = [m["tokens"], m["medium"]["fs_type"] + ":" + os.path.basename(m["dir"].rstrip("/"))]
        if "error" in m or "oom" in m:
            rows.append(where + ["-", (m.get("oom") or m.get("error"))[:70]])
        for name, p in m.get("paths", {}).items():
            if "ttft_ms" not in p:
                why = p.get("oom") or p.get("error") or p.get("skipped") or "?"
                if "skipped" in p and "bit_exact_kv" in p:
                    why = f"exact {exact(p)}, skipped: {why}"
                rows.append(where + [name, why[:70]])
                continue
            rows.append(where + [
                name, _num(p["ttft_ms"], ".1f"), _num(p.get("restore_io_ms"), ".1f"),
                _num(p.get("suffix_ms"), ".1f"), _num(p["speedup"], ".2f", "x"),
                _num(p["restore_gbps"], ".2f"), _num(m.get("raw_kvikio", {}).get("gbps"), ".2f"),
                _num(p.get("restore_vs_raw_alternating", p.get("restore_vs_raw")), ".2f"),
                _num(m.get("break_even_gbps") if name == "restore" else
                     p.get("break_even_gbps"), ".2f"),
                _num(p.get("spill_ms", m.get("spill", {}).get("ms")), ".1f"),
                _num(m.get("decode", {}).get("slowdown"), ".2f", "x"),
                _num(m.get("decode", {}).get("graph", {}).get("slowdown"), ".2f", "x"), exact(p)])
    full = [cols] + [r for r in rows if len(r) == len(cols)]
    widths = [max(len(str(r[i])) for r in full) for i in range(len(cols))]

    def line(r) -> str:
        cells = [str(v).ljust(w) if i in (1, 2) else str(v).rjust(w)
                 for i, (v, w) in enumerate(zip(r, widths))]
        if len(r) < len(cols):  # a failure: N, medium and path, then why
            cells[-1] = str(r[-1])
        return " ".join(cells)
    attention = [
        f"{m['tokens']} {m['medium']['fs_type']}: restore_graph suffix by attention: " + ", ".join(
            f"{kind} {a['suffix_ms']:.1f} ms ({'exact' if a['bit_exact_logits'] else 'NOT EXACT'})"
            for kind, a in m["paths"]["restore_graph"]["suffix_attention"].items())
        for m in result["runs"] if "suffix_attention" in m.get("paths", {}).get("restore_graph", {})]
    return "\n".join([line(r) for r in [cols] + rows] + attention)


def plot(result: dict, path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"plot skipped: matplotlib not importable ({exc})"
    fig, ax = plt.subplots(figsize=(8, 5))
    pre = sorted((int(n), p["ttft_ms"]) for n, p in result["prefill"].items() if "ttft_ms" in p)
    if pre:
        ax.plot(*zip(*pre), "k-o", label="prefill")
    series: dict[tuple[str, str], list] = {}
    for m in result["runs"]:
        where = f"{m['medium']['fs_type']} {m['dir']}"
        for name, p in m.get("paths", {}).items():
            if "ttft_ms" in p:
                series.setdefault((name, where), []).append((m["tokens"], p["ttft_ms"]))
    # a colour per path, a line style per store directory
    colours = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(n for n, _ in series))}
    styles = {w: s for w, s in zip(dict.fromkeys(w for _, w in series), ("-", "--", ":", "-."))}
    for (name, where), points in series.items():
        ax.plot(*zip(*sorted(points)), marker=".", color=colours[name],
                linestyle=styles.get(where, "-"), label=f"{name} ({where})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens N")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"TTFT: restore from gdskv vs prefill ({result['device']['name']}, "
                 f"{result['model']['name']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot written to {path}"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=REPO, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": "cpu", "type": "cpu"}
    p = torch.cuda.get_device_properties(device)
    return {"name": p.name, "type": "cuda", "memory_gib": round(p.total_memory / 2**30, 1)}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dirs", help="store directories, comma separated (e.g. "
                                   "/dev/shm/x,/var/tmp/x)")
    ap.add_argument("--from-json", metavar="PATH[,PATH...]",
                    help="run nothing: print the table of results written before, several "
                         "calls' as one (and --plot them: where matplotlib is, if the GPU "
                         "machine has none)")
    ap.add_argument("--tokens", type=parse_tokens, default=None,
                    help="prompt lengths, comma separated, 'k' = 1024 (default "
                         "1k,2k,8k,32k,64k,128k; --quick: 2k,8k; --tiny: 64,128)")
    ap.add_argument("--quick", action="store_true",
                    help="2k and 8k tokens, one sample, 16 decode steps, no restore_pool_copy "
                         "(unless --paths names it)")
    ap.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    ap.add_argument("--model", choices=sorted(MODELS), default="llama3-8b",
                    help="the random-weight model: Llama-3-8B's shape (default) or "
                         "DeepSeek-V2-Lite's (multi-head latent attention, mixture of experts); "
                         "with --tiny its 2-layer version")
    ap.add_argument("--tiny", action="store_true",
                    help="the example's 2-layer model (for the CPU) instead of Llama-3-8B's shape")
    ap.add_argument("--page-size", type=int, default=16, help="tokens a page (default 16)")
    ap.add_argument("--repeat", type=int, default=3,
                    help=f"samples a measurement, median reported (N > {REPEAT_UP_TO}: one, but "
                         "for restore_graph)")
    ap.add_argument("--decode-context", type=int, default=None,
                    help="the decoding request's cache (default 2048; --tiny 32)")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="decode steps timed (default 64; --quick 16)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode-slowdown runs")
    ap.add_argument("--paths", default=None,
                    help="restore paths to run, comma separated, of " + ",".join(RESTORE_PATHS)
                         + " (default all; --quick: all but restore_pool_copy). The prefill "
                           "always runs ('prefill' may be named)")
    ap.add_argument("--suffix-attention", default="flash,grouped,mask",
                    help="restore_graph: the suffix forward's attention, comma separated, of "
                         f"{', '.join(SUFFIX_ATTENTIONS)}; the first gives the TTFT, each other "
                         "is timed on the same restored cache (default flash,grouped,mask)")
    ap.add_argument("--drop-caches", choices=("machine", "files"), default=None,
                    help="before each read: 'files' = fadvise(DONTNEED) on the slab files; "
                         "'machine' = that and 1 into /proc/sys/vm/drop_caches (root; the "
                         "default, except with --tiny)")
    ap.add_argument("--backend", default=None,
                    help="gdskv backend (default kvikio where importable on a GPU, else posix)")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--plot", help="write a PNG of TTFT against N here (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.from_json:
        return args
    if not args.dirs:
        ap.error("--dirs is required (or --from-json)")
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu --tiny)")
    if args.device.type == "cpu" and not args.tiny:
        ap.error("--device cpu takes --tiny: the full models' shapes are for the GPU")
    if args.page_size < 1:
        ap.error(f"--page-size must be >= 1, got {args.page_size}")
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            ap.error(f"{option} {path}: its directory does not exist")
    args.dirs = [d for d in (p.strip() for p in args.dirs.split(",")) if d]
    if not args.dirs:
        ap.error("--dirs: no directory given")
    if args.tokens is None:
        args.tokens = [64, 128] if args.tiny else list(QUICK_TOKENS if args.quick else FULL_TOKENS)
    if args.paths is None:
        args.paths = [p for p in RESTORE_PATHS if not (args.quick and p == "restore_pool_copy")]
    else:
        args.paths = [p for p in (p.strip() for p in args.paths.split(",")) if p]
        unknown = sorted(set(args.paths) - set(RESTORE_PATHS) - {"prefill"})
        if unknown or not args.paths:
            ap.error(f"--paths: {', '.join(unknown) or 'none given'}: name some of prefill,"
                     + ",".join(RESTORE_PATHS))
    args.suffix_attention = [a for a in (a.strip() for a in args.suffix_attention.split(","))
                             if a]
    wrong = sorted(set(args.suffix_attention) - set(SUFFIX_ATTENTIONS))
    if wrong or not args.suffix_attention:
        ap.error(f"--suffix-attention: {', '.join(wrong) or 'none given'}: name some of "
                 + ",".join(SUFFIX_ATTENTIONS))
    if args.quick:
        args.repeat = 1
    args.drop_caches = args.drop_caches or ("files" if args.tiny else "machine")
    args.decode_context = args.decode_context or (32 if args.tiny else 2048)
    args.decode_steps = args.decode_steps or (16 if args.quick else 64)
    return args


@torch.no_grad()
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        result = None
        for path in args.from_json.split(","):  # several calls' results as one
            with open(path, encoding="utf-8") as f:
                part = json.load(f)
            if result is None:
                result = part
            else:
                result["prefill"].update(part["prefill"])
                result["runs"] += part["runs"]
        if args.plot:
            print(plot(result, args.plot))
        print(table(result))
        return 0
    import transformers
    ex = example()

    backend, why = backend_choice(args.device)
    args.backend = args.backend or backend
    full_name, build, tiny_build, tiny_name = MODELS[args.model]
    if args.tiny:
        model = getattr(ex, tiny_build)(args.device, torch.float32)
        name = tiny_name
    else:
        model = build(args.device, max(args.tokens))
        name = full_name
    try:  # the example's layout takes page_size x kv_heads rows a page: refused before the runs
        layout = ex.cache_layout(model.config, args.page_size, model.dtype)
    except ValueError as exc:
        raise SystemExit(f"--page-size: {exc}")
    layers = model.config.num_hidden_layers
    (heads, head_dim), values = ex.cache_parts(model.config)
    kv_token = ex.kv_bytes_per_token(model.config, model.dtype)
    media = []
    for d in args.dirs:
        os.makedirs(d, exist_ok=True)
        media.append(medium(d))
    result = {"experiment": "ttft", "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
              "device": device_info(args.device), "torch": torch.__version__,
              "transformers": transformers.__version__,
              "model": {"name": name, "layers": layers, "kv_heads": heads, "head_dim": head_dim,
                        "value_heads_width": list(values), "tier_layout": layout.fingerprint,
                        "dtype": str(model.dtype), "kv_bytes_per_token": kv_token,
                        "attn": getattr(model.config, "_attn_implementation", None)},
              "page_size": args.page_size, "backend_asked": args.backend,
              "drop_caches": args.drop_caches,
              "backend_because": why, "media": media, "repeat": args.repeat,
              "quick": args.quick, "paths": args.paths, "prefill": {}, "runs": []}
    # one-time costs out of the timings: kernels of a prefill, a cached prefill, a decode step
    _, warm = ex.forward(model, torch.zeros(1, 256, dtype=torch.long, device=args.device))
    ex.forward(model, torch.zeros(1, 16, dtype=torch.long, device=args.device), warm)
    del warm
    # as the engines do once their model is loaded and warmed up (SGLang's freeze_gc, vLLM's
    # GC heap freeze): the model's objects leave the collector's generations, so a collection
    # that a timed call's allocations trigger does not walk them
    gc.collect()
    gc.freeze()
    result["gc_frozen"] = True
    decoder = None  # (the eager decoder, the graph-replayed one: None on the CPU)
    if not args.no_decode:
        eager = Decoder(ex, model, args.decode_context, args.decode_steps, args.device)
        decoder = (eager, GraphDecoder(ex, model, eager) if args.device.type == "cuda" else None)
    too_big = None
    for n in args.tokens:
        key = str(n)
        if too_big is not None and n > too_big:
            result["prefill"][key] = {"oom": f"skipped: the prefill of {too_big} ran out of memory"}
            continue
        if args.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)
        run = None
        try:
            run = Run(args, ex, model, n)
        except Exception as exc:  # noqa: BLE001 - recorded; larger N are skipped after an OOM
            result["prefill"][key] = {"oom" if is_oom(exc) else "error": repr(exc)[:500]}
            if is_oom(exc):
                too_big = n
        if run is None:
            free_memory()
            continue
        result["prefill"][key] = {**run.prefill, "hash_ms": run.hash_ms, "pages": len(run.keys)}
        if not run.hits:
            result["prefill"][key]["note"] = "no whole page before the last token: no restore"
        for d, m in zip(args.dirs if run.hits else (), media):
            entry = guarded(lambda: run_medium(run, args, d, decoder))
            entry.setdefault("tokens", n)
            entry.setdefault("dir", d)
            result["runs"].append({**entry, "medium": m})
            print(f"N={n} {d}: " + ", ".join(
                f"{k} {p['ttft_ms']:.1f} ms" if "ttft_ms" in p else
                f"{k} {'skipped' if 'skipped' in p else 'failed'}"
                for k, p in entry.get("paths", {}).items()), flush=True)
        if args.device.type == "cuda":
            result["prefill"][key]["peak_gpu_gib"] = round(
                torch.cuda.max_memory_allocated(args.device) / 2**30, 2)
        del run
        free_memory()
        settle(result, args.json, complete=False)  # what is done survives a killed run
    settle(result, args.json, complete=True)
    notes = [plot(result, args.plot)] if args.plot else []
    backends = {m["backend"]["backend"] for m in result["runs"] if "backend" in m}
    compat = {str(m["backend"]["backend_detail"].get("compat_mode")) for m in result["runs"]
              if m.get("backend", {}).get("backend") == "kvikio"}
    print("\n".join(notes))
    print(f"\n{result['device']['name']}, {name}, transformers {transformers.__version__}, "
          f"backend {'/'.join(sorted(backends)) or args.backend} (kvikio compat mode: "
          f"{'/'.join(sorted(compat)) or '-'}), {args.page_size}-token pages; page cache: "
          + "; ".join(f"{m['dir']}: " + next((p["page_cache"] for p in m.get("paths", {}).values()
                                               if "page_cache" in p), "?")
                      for m in result["runs"][:len(args.dirs)]))
    print(table(result))
    for label, bad in (("NOT BIT-EXACT", result["not_bit_exact"]), ("ERRORS", result["errors"])):
        if bad:
            print(f"{label}: " + "; ".join(bad))
    return 1 if result["not_bit_exact"] or result["errors"] else 0


def settle(result: dict, path: str | None, *, complete: bool) -> None:
    """Name the failed checks and the errors (out of memory is neither), and write the JSON."""
    result["not_bit_exact"] = [
        f"N={m['tokens']} {m['dir']} {name}" for m in result["runs"]
        for name, p in m.get("paths", {}).items()
        if "bit_exact_kv" in p and exact(p) != "ok"]
    for m in result["runs"]:  # restore_graph: each attention's replay and restored suffix
        g = m.get("paths", {}).get("restore_graph", {})
        result["not_bit_exact"] += [
            f"N={m['tokens']} {m['dir']} restore_graph {what} ({kind})"
            for what, checks, field in (("graph vs eager", g.get("graph_vs_eager", {}), "bit_exact"),
                                        ("suffix", g.get("suffix_attention", {}),
                                         "bit_exact_logits"))
            for kind, c in checks.items() if not c[field]]
    result["errors"] = [f"prefill N={n}" for n, p in result["prefill"].items() if "error" in p]
    for m in result["runs"]:
        parts = [("", m)] + list(m.get("paths", {}).items()) + [
            ("raw_kvikio", m.get("raw_kvikio", {})),
            ("raw_kvikio_first", m.get("raw_kvikio_first", {})), ("decode", m.get("decode", {}))]
        result["errors"] += [f"N={m['tokens']} {m['dir']} {k}".rstrip() for k, p in parts
                             if "error" in p]
    result["complete"] = complete
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)

if __name__ == "__main__":
    raise SystemExit(main())
