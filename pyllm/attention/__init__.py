"""Attention backends: one object per KV-cache layout.

backend.py defines what a layout supplies (AttentionBackend: the step's metadata and
its checks, the attention ops, the cache, the tensor-parallel packing) and the shapes
it shares (KVCache, CacheSpec); metadata.py the fields every layout has; paged.py and
contiguous.py the two layouts; registry.py finds one by name.
"""
