"""Engine glue: ``sglang`` (SGLang HiCache L3 backend) and ``vllm`` (vLLM's offloading spec,
connector and secondary tier). Each subpackage imports its engine lazily, where it is used."""

import re


def safe_name(text: str) -> str:
    """A file-name-safe form of a model name or path (no ``/``, no ``|``), for store paths."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"
