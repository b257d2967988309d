"""paged_backend.tgi: text-generation-inference compatibility.

- `launch` (`launcher/launch.py`, `python -m paged_backend.tgi`): TGI's HTTP API (`http/app.py`) with
  text-generation-launcher's flags, on `--backend paged | reference | grpc`.
- `shard/` (`text-generation-server serve`, `python -m paged_backend.tgi.shard`): a generate.v3 gRPC shard
  the real TGI router can drive.
- `router/`: the Python v3 router behind `--backend grpc`.
"""
