"""End to end with a real model: a small random-init Llama (transformers, fixed seed, nothing
downloaded) prefills a prompt; its KV goes into a layer-first paged pool at scattered slots;
gdskv spills the pages, the pool is wiped, gdskv restores them into other slots, the model's
cache is rebuilt from the pool and greedy decoding goes on for 40 tokens. Tokens and logits must
be bit-identical to the run that never left the model's cache.

Runs on every backend the conftest offers: posix (and nixl) on CPU, kvikio on CUDA.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install transformers)")

from gdskv.layout import KVLayout  # noqa: E402
from gdskv.tier import Tier  # noqa: E402

PAGE = 8
PROMPT_PAGES = 3
DECODE_STEPS = 40


def tiny_llama(device):
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.float32).eval()
    return model, cfg


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of one layer, [batch, kv_heads, seq, head_dim], across transformers versions."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def cache_from(keys: list[torch.Tensor], values: list[torch.Tensor]):
    cache = transformers.DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)
    return cache


@torch.no_grad()
def greedy(model, cache, first_token: torch.Tensor, start: int, steps: int):
    """Greedy decode from ``cache``; returns (tokens, logits) of every step."""
    tokens, logits = [], []
    tok = first_token
    for i in range(steps):
        pos = torch.tensor([[start + i]], device=tok.device)
        out = model(input_ids=tok, past_key_values=cache, use_cache=True, position_ids=pos)
        step_logits = out.logits[:, -1, :]
        tok = step_logits.argmax(-1, keepdim=True)
        tokens.append(tok)
        logits.append(step_logits)
    return torch.cat(tokens, 1), torch.stack(logits, 1)


def page_keys(prompt: torch.Tensor) -> list[str]:
    """Chained SHA-256 of each page's token ids (how engines name prefix pages)."""
    keys, prev = [], b""
    for p in range(prompt.shape[1] // PAGE):
        h = hashlib.sha256(prev + prompt[0, p * PAGE:(p + 1) * PAGE].cpu().numpy().tobytes())
        prev = h.digest()
        keys.append(h.hexdigest())
    return keys


@torch.no_grad()
def test_spilled_and_restored_kv_decodes_bit_exact(make_config, device):
    model, cfg = tiny_llama(device)
    g = torch.Generator().manual_seed(1)
    seq = PROMPT_PAGES * PAGE
    prompt = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=g).to(device)
    context, first = prompt[:, :seq], prompt[:, seq:]

    # The run that never spills.
    ref_cache = model(input_ids=context, use_cache=True).past_key_values
    ref_tokens, ref_logits = greedy(model, ref_cache, first, seq, DECODE_STEPS)

    # Same prefill, KV copied into an engine-style layer-first pool at scattered slots.
    cache = model(input_ids=context, use_cache=True).past_key_values
    layers, heads, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    num_slots = 8 * seq
    pool = tuple(torch.zeros(layers, num_slots, heads, hd, device=device) for _ in range(2))
    perm = torch.randperm(num_slots, generator=g)
    src_slots, dst_slots = perm[:seq].to(device), perm[seq:2 * seq].to(device)
    for layer in range(layers):
        for part, t in zip(pool, layer_kv(cache, layer)):
            part[layer, src_slots] = t[0].transpose(0, 1)  # [seq, heads, hd]
    del cache

    layout = KVLayout(num_layers=layers, page_size=PAGE, head_dim=hd, kv_heads=heads,
                      dtype=torch.float32, model_name="tiny-llama")
    keys = page_keys(context)
    with Tier(layout, make_config(), device=device) as tier:
        assert tier.put(keys, pool, src_slots) == [True] * PROMPT_PAGES
        for part in pool:
            part.zero_()
        assert tier.match_prefix(keys) == PROMPT_PAGES
        assert tier.get(keys, pool, dst_slots) == [True] * PROMPT_PAGES
        backend = tier.stats()["backend"]
    assert backend == make_config().backend.value

    restored_k = [pool[0][layer, dst_slots].transpose(0, 1).unsqueeze(0).contiguous()
                  for layer in range(layers)]
    restored_v = [pool[1][layer, dst_slots].transpose(0, 1).unsqueeze(0).contiguous()
                  for layer in range(layers)]
    tokens, logits = greedy(model, cache_from(restored_k, restored_v), first, seq, DECODE_STEPS)
    assert tokens.shape == (1, DECODE_STEPS)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)

    # The cache matters: decoding from a wiped cache gives other logits.
    zeros = [torch.zeros_like(k) for k in restored_k]
    _, wrong = greedy(model, cache_from(zeros, zeros), first, seq, 2)
    assert not torch.equal(wrong, ref_logits[:, :2])
