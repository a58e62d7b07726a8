"""LightLLM's own CPU cache and disk cache worker, set up as its multi-level cache manager process
sets them up, for the LightLLM adapter tests (.venv-lightllm). LightLLM reads its start arguments
from the LIGHTLLM_START_ARGS environment variable and the model's shape from config.json; both
are written here for a tiny model of each page shape."""

from __future__ import annotations

import json
import os
import sys
import uuid

#: config.json of a tiny model per page shape; the cache manager class LightLLM picks for it
#: decides the page layout (MHA: K and V heads; MLA: one 576-wide latent; int8kv: int8 K/V and
#: their scales in one row)
MODELS = {
    "mha": ({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
             "head_dim": 16, "vocab_size": 128, "torch_dtype": "bfloat16"}, "None"),
    "mla": ({"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
             "hidden_size": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
             "vocab_size": 128, "torch_dtype": "bfloat16"}, "None"),
    "int8kv": ({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "hidden_size": 64, "head_dim": 16, "vocab_size": 128,
                "torch_dtype": "bfloat16"}, "int8kv"),
}


def clear_lightllm_caches() -> None:
    """LightLLM memoises its start arguments' consequences (page shape, model class) per process;
    each test starts another 'server', so forget them."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("lightllm") and mod is not None:
            for value in list(vars(mod).values()):
                if callable(getattr(value, "cache_clear", None)) and \
                        getattr(value, "__module__", "").startswith("lightllm"):
                    value.cache_clear()


def start_server_env(tmp_path, shape: str, *, cpu_pages: int, token_page_size: int = 4,
                     disk_gib: float = 0.25, disk_dir=None) -> dict:
    """Write the model and LightLLM's start arguments for one 'server'; returns the arguments."""
    config, kv_type = MODELS[shape]
    model_dir = tmp_path / f"model-{shape}"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    args = dict(model_dir=str(model_dir), enable_cpu_cache=True, enable_disk_cache=True,
                cpu_cache_token_page_size=token_page_size, data_type="bf16",
                llm_kv_type=kv_type, mtp_mode=None, cpu_cache_storage_size=1.0,
                cpu_kv_cache_shm_id=int(uuid.uuid4().int % (1 << 30)) + 1,
                disk_cache_storage_size=disk_gib,
                disk_cache_dir=str(disk_dir or tmp_path / "disk"), diverse_mode=False)
    os.environ["LIGHTLLM_START_ARGS"] = json.dumps(args)
    os.environ["LIGHTLLM_UNIQUE_SERVICE_NAME_ID"] = f"gdskvtest{uuid.uuid4().hex[:10]}"
    os.environ["LIGHTLLM_DISK_CACHE_PROMPT_LIMIT_LENGTH"] = "0"
    clear_lightllm_caches()
    _pick_memory_manager(shape)
    # a CPU cache of cpu_pages pages: the size LightLLM derives its page count from
    from lightllm.utils.kv_cache_utils import calcu_cpu_cache_meta
    calcu_cpu_cache_meta.cache_clear()
    args["cpu_cache_storage_size"] = 1.0
    page_bytes = _page_bytes()
    args["cpu_cache_storage_size"] = (cpu_pages * page_bytes + 0.5) / (1 << 30)
    os.environ["LIGHTLLM_START_ARGS"] = json.dumps(args)
    clear_lightllm_caches()
    return args


def _pick_memory_manager(shape: str) -> None:
    """LightLLM picks the KV memory manager class (hence the CPU page shape) from its model
    class, which needs its whole model zoo; the snapshot in ../shared/upstream lacks files of
    some models (e.g. lightllm/models/qwen3next/layer_weights), so the zoo does not import. The
    pick is made here the way select_mem_manager_class makes it for these models (llama ->
    MemoryManager, or PPLINT8KVMemoryManager with llm_kv_type int8kv; deepseek_v2 ->
    Deepseek2MemoryManager); everything after it is LightLLM's own code."""
    import lightllm.utils.kv_cache_utils as kcu
    pick = {"mha": kcu.MemoryManager, "mla": kcu.Deepseek2MemoryManager,
            "int8kv": kcu.PPLINT8KVMemoryManager}[shape]
    kcu.select_mem_manager_class = lambda: pick


def _page_bytes() -> int:
    from lightllm.utils.kv_cache_utils import calcu_cpu_cache_meta
    return calcu_cpu_cache_meta().calcu_one_page_size()
