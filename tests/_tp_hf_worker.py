"""Run by torchrun (tests/test_hf_tensor_parallel.py): PagedCache on a model loaded with tp_plan="auto".

Every rank generates greedily with DynamicCache, then PagedCache under sdpa and under paged_backend attention;
rank 0 writes what it saw as JSON to argv[2].
"""

import json
import os
import sys

import torch

from paged_backend.hf import PagedCache
from paged_backend.worker.attention import register_paged_attention

torch.set_num_threads(1)


def main(model_dir: str, out_path: str, prompt_rows: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    batch = json.loads(prompt_rows)
    inputs = {name: torch.tensor(value) for name, value in batch.items()}
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=255)
    report = {"tp_size": model.tp_size, "dynamic": model.generate(**inputs, **settings).tolist()}
    for attn in ("sdpa", register_paged_attention()):
        model.set_attn_implementation(attn)
        cache = PagedCache(model, max_tokens=256)
        report[attn] = model.generate(**inputs, past_key_values=cache, **settings).tolist()
        report["pool_kv_heads"] = cache.kv_cache.num_kv_heads
        cache.reset()
        report[f"{attn}_blocks_back"] = cache.block_manager.num_free_blocks == cache.block_manager.num_blocks - 1
    if int(os.environ["RANK"]) == 0:
        with open(out_path, "w") as out:
            json.dump(report, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
