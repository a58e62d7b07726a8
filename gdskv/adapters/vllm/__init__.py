"""gdskv for vLLM 0.33's KV offloading, at its two out-of-tree plug points (docs/vllm.md):

- :mod:`.connector` + :mod:`.spec`: the GPU-direct path, an ``OffloadingSpec`` whose worker moves
  blocks between vLLM's GPU KV cache and gdskv's slab store (no CPU tier in between), loaded by
  gdskv's connector so a block that fails to load is recomputed;
- :mod:`.secondary`: a ``SecondaryTierManager`` below vLLM's CPU tier.

:mod:`.mapping` (geometry, stores, keys), :mod:`.blocks` (the GPU-direct data path) and
:mod:`.index` (the scheduler's view of the stores) import no vLLM code.
"""
