"""Quantized weights (fp32, bf16, torchao int8 / int4 weight-only) and fp8 KV pools against fp32, in one run.

A thin caller of paged_backend/bench/quantization.py, with the same flags.

    python benchmarks/quantization.py
"""

from paged_backend.bench.quantization import main

if __name__ == "__main__":
    main()
