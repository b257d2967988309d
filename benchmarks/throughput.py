"""Offline throughput: HF static `generate`, HF continuous batching, and the paged-backend engine.

A thin caller of `paged-backend bench throughput` (paged_backend/bench/throughput.py), with the same flags.

    python benchmarks/throughput.py --quick          # 32 requests, tiny model, a couple of minutes
    python benchmarks/throughput.py                  # 200 requests, ~100M-parameter Llama (slow on CPU)
    python benchmarks/throughput.py --model default --dataset chat   # SmolLM2 on chat prompts, natural EOS
"""

from paged_backend.bench.throughput import main

if __name__ == "__main__":
    main()
