"""Run under torchrun: every rank builds the same `LLM(..., tensor_parallel_size=2)`; rank 0 drives and writes
the greedy tokens of each model as JSON; other ranks serve its steps inside `LLM()`, which ends with SystemExit(0).

usage: torchrun ... tests/_torchrun_generate.py OUT.json MODEL_DIR...
"""

import json
import sys

import torch

from paged_backend.engine import LLM
from tests._distributed_helpers import DTYPE, generate

torch.set_num_threads(1)
out_path, *model_dirs = sys.argv[1:]
results = {}
for model_dir in model_dirs:
    try:
        llm = LLM(model_dir, device="cpu", dtype=DTYPE, num_blocks=64, block_size=4, tensor_parallel_size=2)
    except SystemExit:  # a worker rank: it served this model's steps until the driver closed; on to the next
        continue
    results[model_dir] = generate(llm)
    llm.engine.close()
if results:
    with open(out_path, "w") as out:
        json.dump(results, out)
