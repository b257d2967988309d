"""A generate.v3 `TextGenerationService` shard on this project's core, for TGI's router (or ours).

The router owns scheduling and KV block allocation (`Request.blocks` / `slots`); the shard owns the pool,
the forward (the engine's `ModelRunner` packing + `PackedKV` attention), sampling (the engine's `Sampler`),
stopping and detokenization with TGI's semantics, and keeps batches between calls by id.
"""
