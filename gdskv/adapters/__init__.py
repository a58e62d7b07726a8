"""Engine glue: ``sglang`` (SGLang HiCache L3 backend), ``vllm`` (vLLM's offloading spec,
connector and secondary tier), ``lmcache`` (an LMCache L2 adapter) and ``lightllm`` (LightLLM's
disk cache). Each imports its engine lazily, where it is used; what they share is
:mod:`.common`."""
