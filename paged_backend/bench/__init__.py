"""`paged-backend bench`: the offline throughput, batch-1 latency and online serving benchmarks.

The scripts in benchmarks/ are thin callers of these modules, so the numbers in benchmarks/RESULTS.md come
from the same code a pip user runs.
"""
