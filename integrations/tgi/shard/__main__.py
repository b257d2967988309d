"""`python -m paged_backend.tgi.shard serve MODEL_ID --uds-path ...`: the same as `text-generation-server`."""

from paged_backend.tgi.shard.cli import app

app(prog_name="text-generation-server")
