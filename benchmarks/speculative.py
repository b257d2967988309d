"""Speculative decoding (n-gram lookup, a truncated-layer draft model) against plain decoding, in one run.

A thin caller of paged_backend/bench/speculative.py, with the same flags.

    python benchmarks/speculative.py
"""

from paged_backend.bench.speculative import main

if __name__ == "__main__":
    main()
