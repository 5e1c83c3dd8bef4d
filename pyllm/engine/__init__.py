"""The engine: requests in, tokens out, one step at a time.

Data flows one way: LLMEngine (llm_engine) -> Scheduler (scheduler) -> ModelRunner
(model_runner) -> the model (pyllm.model) -> the kernels (pyllm.ops). The KV cache's
bookkeeping is a KVCacheManager (kv_manager): BlockManager for the paged cache,
SlotManager for the contiguous one.
"""
