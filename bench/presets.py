"""Model presets: the KV geometry of well-known models, and the recompute break-even.

A preset gives what the KV cache looks like (layers, KV heads, head dim, dtype, MLA) and the
active parameter count, from which prefill costs about ``2 x active params`` FLOPs per token
(one multiply-add per weight). That ignores attention's context-length term, which only makes
recompute dearer: the break-even bandwidth computed here is therefore a lower bound for
restoring to beat recomputing.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdskv.layout import KVLayout


@dataclass(frozen=True)
class ModelPreset:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    #: parameters touched per token (all of them for dense models, the routed subset for MoE)
    active_params: float
    dtype: str = "bfloat16"
    mla: bool = False
    hf_name: str = ""

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.active_params

    def layout(self, page_tokens: int, **overrides) -> KVLayout:
        fields = dict(num_layers=self.layers, page_size=page_tokens, head_dim=self.head_dim,
                      kv_heads=self.kv_heads, dtype=self.dtype, mla=self.mla,
                      model_name=self.hf_name or self.name)
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return KVLayout(**fields)


PRESETS: dict[str, ModelPreset] = {p.name: p for p in (
    ModelPreset("llama3-8b", 32, 8, 128, 8.03e9, hf_name="meta-llama/Meta-Llama-3-8B"),
    ModelPreset("llama3-70b", 80, 8, 128, 70.6e9, hf_name="meta-llama/Meta-Llama-3-70B"),
    ModelPreset("qwen2.5-7b", 28, 4, 128, 7.62e9, hf_name="Qwen/Qwen2.5-7B"),
    # MLA: one latent row per token and layer, kv_lora_rank 512 + rope dim 64 = 576.
    # 671B parameters in all, 37B routed per token.
    ModelPreset("deepseek-v3", 61, 1, 576, 37e9, mla=True, hf_name="deepseek-ai/DeepSeek-V3"),
)}


def get_preset(name: str) -> ModelPreset:
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[key]


@dataclass(frozen=True)
class BreakEven:
    """Restore vs. recompute, per token."""
    bytes_per_token: float
    flops_per_token: float
    prefill_tflops: float
    recompute_s_per_token: float
    break_even_bytes_per_s: float
    read_bytes_per_s: float | None = None

    @property
    def restore_s_per_token(self) -> float | None:
        if not self.read_bytes_per_s:
            return None
        return self.bytes_per_token / self.read_bytes_per_s

    @property
    def speedup(self) -> float | None:
        """recompute time / restore time (> 1: restoring wins)."""
        r = self.restore_s_per_token
        return None if r is None else self.recompute_s_per_token / r

    def to_dict(self) -> dict:
        return {"bytes_per_token": self.bytes_per_token, "flops_per_token": self.flops_per_token,
                "prefill_tflops": self.prefill_tflops,
                "recompute_us_per_token": self.recompute_s_per_token * 1e6,
                "restore_us_per_token": (None if self.restore_s_per_token is None
                                         else self.restore_s_per_token * 1e6),
                "read_bytes_per_s": self.read_bytes_per_s,
                "break_even_bytes_per_s": self.break_even_bytes_per_s,
                "restore_speedup": self.speedup}


def break_even(layout: KVLayout, flops_per_token: float, prefill_tflops: float,
               read_bytes_per_s: float | None = None) -> BreakEven:
    """Break-even disk bandwidth: reading a token's KV takes as long as recomputing it."""
    if prefill_tflops <= 0:
        raise ValueError(f"prefill_tflops must be > 0, got {prefill_tflops}")
    if flops_per_token <= 0:
        raise ValueError(f"flops_per_token must be > 0, got {flops_per_token}")
    bytes_per_token = layout.page_bytes / layout.page_size
    recompute = flops_per_token / (prefill_tflops * 1e12)
    return BreakEven(bytes_per_token, flops_per_token, prefill_tflops, recompute,
                     bytes_per_token / recompute, read_bytes_per_s)
