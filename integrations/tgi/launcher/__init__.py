"""`paged-backend launch`: text-generation-launcher's command line and the shard processes it starts."""
