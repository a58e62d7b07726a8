"""A prefix cache for a transformers model: spill a prompt's KV after its prefill, and for the
next request with the same prefix restore it and prefill only the rest.

Pages are ``page_size`` tokens of every layer, named by the chained hash of their token ids, so
two prompts that share a prefix share its pages (keys). ``PrefixCache`` hands the model's own
cache tensors to gdskv, in both directions, with no copy of the KV:

- transformers' ``DynamicCache`` keeps each layer's K and V as ``[1, kv_heads, seq, head_dim]``:
  rows of ``head_dim`` elements, head by head. gdskv moves rows addressed by slot, so a layer is
  handed over as a view ``[kv_heads * seq, 1, head_dim]`` (one head of ``head_dim`` per row), and
  a gdskv page holds, for each layer and head, the page's ``page_size`` tokens: the tier's
  ``KVLayout`` has ``page_size * kv_heads`` rows of one head per page.
- Models whose two cache tensors of a layer differ in width go by column blocks instead:
  DeepSeek-V2/V3 (multi-head latent attention) keep the compressed KV latent
  (``kv_lora_rank`` wide) and the shared rotary key (``qk_rope_head_dim``) as "keys" and
  "values" of one head each. Each is cut into blocks of their widths' greatest common divisor
  (64 elements: 8 blocks of the latent and 1 of the rotary key a layer), and the tier's layout
  is gdskv's latent (MLA) one with a "layer" per block: a page holds, for each block, the
  page's ``page_size`` tokens, all of one token's 576 elements a layer together.
- ``restore`` allocates the new cache's tensors, has gdskv scatter the pages straight into them
  and gives them to a ``DynamicCache`` as they are. (The first forward on that cache copies it
  once, as every ``DynamicCache`` does when it grows.)
- ``restore_static`` has gdskv scatter the pages straight into a ``StaticCache`` made by
  ``static_cache`` (its tensors never move, so a forward over it can run as a CUDA graph).

Runs anywhere: on a GPU with the kvikio backend, on CPU with the POSIX one (a tiny random model,
nothing downloaded). A real model goes the same way: ``AutoModelForCausalLM.from_pretrained``.

    python examples/transformers_prefix_cache.py [--dir /mnt/nvme0/gdskv] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import inspect
import math
import tempfile
import time
import weakref

import numpy as np
import torch
import transformers

from gdskv import KVLayout, TierConfig
from gdskv.layout import MAX_PAGE_SIZE
from gdskv.memory import cuda_available
from gdskv.tier import Tier


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a decoder's attention KV, from its config."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, head_dim


def cache_parts(config) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(heads, width)`` of a layer's two cache tensors, keys then values, as transformers
    keeps them: the K and V heads of most models; for DeepSeek-V2/V3 (MLA, a config with
    ``kv_lora_rank``) the compressed KV latent and the shared rotary key, one head each."""
    if getattr(config, "kv_lora_rank", None):
        return (1, config.kv_lora_rank), (1, config.qk_rope_head_dim)
    _, heads, head_dim = kv_geometry(config)
    return (heads, head_dim), (heads, head_dim)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of one token's KV in the model's cache, all layers."""
    (hk, wk), (hv, wv) = cache_parts(config)
    return config.num_hidden_layers * (hk * wk + hv * wv) * dtype.itemsize


def _block_width(config) -> int | None:
    """The column block of a cache whose two tensors differ in width (see the module's text),
    None when they are alike (one head per row)."""
    (hk, wk), (hv, wv) = cache_parts(config)
    return None if (hk, wk) == (hv, wv) else math.gcd(wk, wv)


def page_keys(token_ids, page_size: int) -> list[str]:
    """Chained SHA-256 of each whole page of token ids: equal prefixes give equal keys."""
    ids = np.asarray(token_ids.cpu() if isinstance(token_ids, torch.Tensor) else token_ids,
                     dtype=np.int64).reshape(-1)
    keys, prev = [], b""
    for start in range(0, len(ids) - page_size + 1, page_size):
        prev = hashlib.sha256(prev + ids[start:start + page_size].tobytes()).digest()
        keys.append(prev.hex())
    return keys


def cache_from(keys: list[torch.Tensor], values: list[torch.Tensor]) -> transformers.DynamicCache:
    """A ``DynamicCache`` holding these per-layer ``[1, heads, seq, head_dim]`` tensors
    themselves (``DynamicCache.update`` would copy them)."""
    cache = transformers.DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k[..., :0, :], v[..., :0, :], layer)  # makes the layer: dtype, device
        cache.layers[layer].keys, cache.layers[layer].values = k, v
    return cache


def static_cache(model, max_tokens: int) -> transformers.StaticCache:
    """A ``StaticCache`` for one sequence of up to ``max_tokens`` tokens, its tensors allocated
    now (``[1, kv_heads, max_tokens, head_dim]`` a layer; left alone, transformers would make
    them at the first forward)."""
    (hk, wk), (hv, wv) = cache_parts(model.config)
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_tokens)
    if (hk, wk) == (hv, wv):
        cache.early_initialization(1, hk, wk, model.dtype, model.device)
    else:  # (early_initialization makes keys and values alike)
        for layer in cache.layers:
            layer.lazy_initialization(
                torch.zeros(1, hk, 0, wk, dtype=model.dtype, device=model.device),
                torch.zeros(1, hv, 0, wv, dtype=model.dtype, device=model.device))
    return cache


@functools.lru_cache(maxsize=None)
def cache_argument(model_class: type) -> str:
    """What ``forward`` calls the cache: ``cache`` since transformers 5.2x (it warns on the old
    name), ``past_key_values`` before."""
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(model, ids: torch.Tensor, cache=None):
    """Prefill ``ids`` (``[1, n]``) after ``cache``: the last position's logits and the cache.
    Only the last position's logits are computed (a 128k vocabulary times every position would
    cost more than the rest)."""
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1,
                **({cache_argument(type(model)): cache} if cache is not None else {}))
    cache = out.get("cache")
    return out.logits[:, -1], out.get("past_key_values") if cache is None else cache


def cache_layout(model_config, page_size: int, dtype: torch.dtype,
                 model_name: str = "") -> KVLayout:
    """The tier's layout for a model's cache: a page is ``page_size`` tokens of every layer and
    head, stored as ``page_size * kv_heads`` rows of one head each, or, where keys and values
    differ in width, as ``page_size`` rows of each column block (see the module's text)."""
    layers = model_config.num_hidden_layers
    block = _block_width(model_config)
    if block is not None:
        (hk, wk), (hv, wv) = cache_parts(model_config)
        return KVLayout(num_layers=layers * (hk * wk + hv * wv) // block, page_size=page_size,
                        head_dim=block, kv_heads=1, mla=True, dtype=dtype,
                        model_name=model_name or model_config.model_type)
    _, heads, head_dim = kv_geometry(model_config)
    if page_size * heads > MAX_PAGE_SIZE:
        raise ValueError(f"page_size {page_size} x {heads} KV heads is over gdskv's "
                         f"{MAX_PAGE_SIZE} rows a page: use page_size <= {MAX_PAGE_SIZE // heads}")
    return KVLayout(num_layers=layers, page_size=page_size * heads, head_dim=head_dim,
                    kv_heads=1, dtype=dtype, model_name=model_name or model_config.model_type)


class PrefixCache:
    """Whole-page prompt prefixes of one model in a gdskv tier."""

    def __init__(self, model_config, tier_config: TierConfig, *, page_size: int = 16,
                 dtype: torch.dtype, device, model_name: str = "") -> None:
        self.num_layers = model_config.num_hidden_layers
        self.parts = cache_parts(model_config)  # ((heads, width) of keys, of values)
        self.block = _block_width(model_config)
        self.page_size = page_size
        self.layout = cache_layout(model_config, page_size, dtype, model_name)
        self.tier = Tier(self.layout, tier_config, device=device)
        #: StaticCache -> (its tensors' addresses, pool view, slots): see _static_pool
        self._static_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def page_keys(self, token_ids) -> list[str]:
        return page_keys(token_ids, self.page_size)

    def pool(self, keys: list[torch.Tensor], values: list[torch.Tensor], pages: int):
        """The tier's view of per-layer ``[1, heads, seq, width]`` K and V tensors and the
        slots of their first ``pages`` pages: ``(kv_pool, token_slots)``."""
        seq = keys[0].shape[-2]
        if keys[0].shape[0] != 1:
            raise ValueError(f"one sequence at a time: the cache holds a batch of "
                             f"{keys[0].shape[0]}")
        if pages * self.page_size > seq:
            raise ValueError(f"{pages} pages of {self.page_size} tokens: the cache holds {seq}")
        device = keys[0].device
        # (a cache cut short by crop() is a view: .contiguous() copies it, else it is a no-op)
        if self.block is not None:  # a "layer" of the tier per column block, token = slot
            b = self.block
            rows = [t[0, h, :, j * b:(j + 1) * b].unsqueeze(1)
                    for k, v in zip(keys, values) for t in (k.contiguous(), v.contiguous())
                    for h in range(t.shape[1]) for j in range(t.shape[-1] // b)]
            return (rows,), torch.arange(pages * self.page_size, device=device)
        heads, head_dim = self.parts[0]
        rows = tuple([t.contiguous().view(heads * seq, 1, head_dim) for t in part]
                     for part in (keys, values))
        # page p, row i = head * page_size + token: slot head * seq + p * page_size + token
        per_page = (torch.arange(heads, device=device)[:, None] * seq
                    + torch.arange(self.page_size, device=device)[None, :]).reshape(-1)
        starts = torch.arange(pages, device=device)[:, None] * self.page_size
        return rows, (starts + per_page[None, :]).reshape(-1)

    def _static_pool(self, cache: transformers.StaticCache, pages: int):
        """``pool()`` of a ``StaticCache``'s tensors, made once per cache: the same view
        tensors every call, so the tier finds its checked view of them (its pool cache knows
        tensors by identity; new views each call would be checked again, a few hundred µs of
        host time for a 32-layer model). Page ``p``'s slots are the ``p``-th run of the
        slots of all the cache's pages, so a shorter restore takes a prefix of them."""
        layers = cache.layers
        ptrs = tuple(layer.keys.data_ptr() for layer in layers)
        made = self._static_pools.get(cache)
        if made is None or made[0] != ptrs:
            whole = layers[0].max_cache_len // self.page_size
            rows, slots = self.pool([layer.keys for layer in layers],
                                    [layer.values for layer in layers], whole)
            made = self._static_pools[cache] = (ptrs, rows, slots)
        rows_per_token = 1 if self.block is not None else self.parts[0][0]
        return made[1], made[2][:pages * self.page_size * rows_per_token]

    def spill(self, keys: list[str], cache) -> int:
        """Store the cache's first ``len(keys)`` pages under ``keys``; how many were stored
        (pages already stored count)."""
        pool, slots = self.pool([layer.keys for layer in cache.layers],
                                [layer.values for layer in cache.layers], len(keys))
        return sum(self.tier.put(keys, pool, slots))

    def _get(self, keys: list[str], pool, slots: torch.Tensor) -> int:
        """gdskv scatters the pages of ``keys`` into ``pool``'s ``slots`` (``pool()``'s
        view); the tokens restored (a page lost since ``match_prefix``, evicted or failing its
        checksum, ends the prefix there)."""
        hits = self.tier.get(keys, pool, slots)
        return (hits.index(False) if False in hits else len(keys)) * self.page_size

    def restore(self, keys: list[str]):
        """The longest stored prefix of ``keys`` as a new ``DynamicCache``: ``(cache, tokens)``,
        ``(None, 0)`` when the first page is not stored."""
        pages = self.tier.match_prefix(keys)
        if pages == 0:
            return None, 0
        ks, vs = ([torch.empty((1, heads, pages * self.page_size, width),
                               dtype=self.layout.torch_dtype, device=self.tier.device)
                   for _ in range(self.num_layers)] for heads, width in self.parts)
        tokens = self._get(keys[:pages], *self.pool(ks, vs, pages))
        if tokens == 0:
            return None, 0
        cache = cache_from([k[..., :tokens, :] for k in ks], [v[..., :tokens, :] for v in vs])
        return cache, tokens

    def restore_static(self, keys: list[str], cache: transformers.StaticCache) -> int:
        """The longest stored prefix of ``keys`` (as much as the cache holds) straight into a
        ``StaticCache``'s own tensors, which then hold that prefix and nothing after it: the
        tokens restored (0 when the first page is not stored)."""
        layers = cache.layers
        if any(layer.is_sliding for layer in layers):  # a ring of the last tokens, not a prefix
            raise ValueError("restore_static: sliding-window layers keep the last tokens in a "
                             "ring, not the prompt's prefix: a full-attention model's cache only")
        if not all(layer.is_initialized for layer in layers):
            raise ValueError("restore_static: the StaticCache has no tensors yet (make it with "
                             "static_cache(), or call its early_initialization())")
        pages = min(self.tier.match_prefix(keys), layers[0].max_cache_len // self.page_size)
        tokens = self._get(keys[:pages], *self._static_pool(cache, pages)) if pages else 0
        # where the next forward writes (transformers' own counter, a tensor a layer): set in
        # one multi-tensor copy, not a fill a layer (32 launches cost 0.6 ms on the H100's host)
        lengths = [layer.cumulative_length for layer in layers]
        torch._foreach_copy_(lengths, [lengths[0].new_full((), tokens)] * len(lengths))
        return tokens

    def close(self) -> None:
        self.tier.close()

    def __enter__(self) -> "PrefixCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tiny_llama(device, dtype):
    """A 2-layer random Llama (nothing downloaded): fast on CPU."""
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=8192)
    return random_model(config, device, dtype)


def random_model(config, device, dtype, **kwargs):
    """``config``'s model with random weights (seed 0), built where it runs (nothing
    downloaded), in eval mode; ``kwargs`` go to ``from_config`` (e.g. attn_implementation)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    return model.eval()


def tiny_deepseek(device, dtype):
    """A 2-layer random DeepSeek-V2 (multi-head latent attention, one dense and one
    mixture-of-experts layer; nothing downloaded): its cache keeps a 32-wide latent and an
    8-wide rotary key a layer."""
    config = transformers.DeepseekV2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        max_position_embeddings=8192)
    return random_model(config, device, dtype)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="store directory (default: a temporary one)")
    ap.add_argument("--tokens", type=int, default=200, help="shared prefix length (default 200)")
    args = ap.parse_args()
    device = torch.device("cuda" if cuda_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = tiny_llama(device, dtype)

    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=g)
    first = torch.cat([prefix, torch.randint(0, 512, (1, 37), generator=g)], 1).to(device)
    second = torch.cat([prefix, torch.randint(0, 512, (1, 21), generator=g)], 1).to(device)

    with tempfile.TemporaryDirectory() as tmp:
        config = TierConfig.from_env(directories=(args.dir or tmp,), capacity="256MiB")
        with PrefixCache(model.config, config, dtype=dtype, device=device) as prefixes:
            # Request 1: prefill it all, answer, then spill its whole pages.
            _, cache = forward(model, first)
            stored = prefixes.spill(prefixes.page_keys(first), cache)
            print(f"request 1: prefilled {first.shape[1]} tokens, spilled {stored} pages")

            # Request 2 shares the prefix: restore what is stored, leaving at least one token
            # to prefill (the model must compute the last position to answer).
            t0 = time.perf_counter()
            keys = prefixes.page_keys(second)[:(second.shape[1] - 1) // prefixes.page_size]
            restored, reused = prefixes.restore(keys)
            logits, _ = forward(model, second[:, reused:], restored)
            ms = (time.perf_counter() - t0) * 1e3
            print(f"request 2: restored {reused} tokens, prefilled {second.shape[1] - reused}, "
                  f"first token {int(logits.argmax())} in {ms:.1f} ms")

            # The same suffix on request 1's own cache, cut to the restored length, gives the
            # same logits bit for bit. (Not a full prefill: other kernels, other roundings.)
            kept = cache_from([layer.keys[..., :reused, :] for layer in cache.layers],
                              [layer.values[..., :reused, :] for layer in cache.layers])
            same_kv = all(torch.equal(a.keys[..., :reused, :], b.keys[..., :reused, :]) and
                          torch.equal(a.values[..., :reused, :], b.values[..., :reused, :])
                          for a, b in zip(restored.layers, cache.layers))
            reference, _ = forward(model, second[:, reused:], kept)
            print(f"restored KV bit-exact: {same_kv}; "
                  f"logits bit-exact: {torch.equal(logits, reference)}")
            s = prefixes.tier.stats()
            print(f"backend {s['backend']} (gpu_direct {s['gpu_direct']}), "
                  f"{s['pages_stored']} pages stored")


if __name__ == "__main__":
    main()
