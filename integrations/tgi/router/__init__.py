"""`--backend grpc`: a Python port of TGI's v3 router driving any generate.v3 shard over a unix socket.

The router owns the queue, the batching loop (prefill / decode / filter, `waiting_served_ratio`,
`max_waiting_tokens`) and KV block allocation (the core `BlockManager`); the shard owns the tensors.
"""
