"""Online serving: Poisson arrivals at several request rates against the OpenAI completions endpoint.

A thin caller of `paged-backend bench serve` (paged_backend/bench/serve.py) with this script's defaults:
rates 2,4,8,16,inf, EOS ignored, results in benchmarks/serving.{json,png}.

    python benchmarks/serving.py                                   # starts the embedded-model server itself
    python benchmarks/serving.py --url http://127.0.0.1:8000 --api-key KEY --request-rates 1,4,16,inf
"""

import sys

from paged_backend.bench.serve import main

DEFAULTS = ["--request-rate", "2,4,8,16,inf", "--ignore-eos", "--output-json", "benchmarks/serving.json",
            "--plot", "benchmarks/serving.png"]  # fmt: skip

if __name__ == "__main__":
    main([*DEFAULTS, *sys.argv[1:]])
