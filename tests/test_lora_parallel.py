"""LoRA under tensor and pipeline parallelism: each rank keeps its part of every adapter (B's rows on
column-parallel layers, A's columns on row-parallel ones, the layers of its own stage), and a batch mixing three
peft adapters and the base model still equals peft's own greedy generate, token for token.

Ranks are worker processes (gloo, one thread each). max_loras=2 with three adapters in flight makes the driver
evict and refill slots mid-run, so the slot writes the ranks replay are exercised too.
"""

from __future__ import annotations

import pytest
import torch
from _lora_helpers import DTYPE, PROMPTS, adapter_builder

from paged_backend.engine import LLM, SamplingParams
from tests._distributed_helpers import close_and_check

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.set_num_threads(1)
    return adapter_builder(tmp_path_factory, MAX_TOKENS)


@pytest.mark.parametrize(
    "arch, layout",
    [
        ("llama", dict(tensor_parallel_size=2)),
        ("qwen2", dict(tensor_parallel_size=2)),
        ("llama", dict(pipeline_parallel_size=2)),
    ],
    ids=["llama-tp2", "qwen2-tp2", "llama-pp2"],
)
def test_mixed_adapters_under_parallelism_equal_peft(built, arch, layout):
    model_dir, loras, expected = built(arch)
    llm = LLM(str(model_dir), device="cpu", dtype=DTYPE, enable_lora=True, max_loras=2, max_lora_rank=8,
              num_blocks=96, block_size=4, **layout)  # fmt: skip
    try:
        pairs = [(i, name) for i in range(len(PROMPTS)) for name in [None, *loras]]
        outputs = llm.generate([PROMPTS[i] for i, _ in pairs], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                               lora_request=[loras.get(name) for _, name in pairs])  # fmt: skip
        for (index, name), output in zip(pairs, outputs, strict=True):
            assert output.outputs[0].token_ids == expected[name][index], (name, index)
    finally:
        close_and_check(llm)
