"""PagedCache under torchrun with transformers' tensor parallelism (tp_plan="auto", gloo on CPU, 2 ranks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from paged_backend.worker.models import byte_tokenizer, tiny_model

WORKER = Path(__file__).with_name("_tp_hf_worker.py")
# Two rows, the second left-padded, so the per-row lengths of the paged path are exercised under TP too.
BATCH = {
    "input_ids": [[253, 72, 101, 108, 108, 111, 33], [255, 255, 253, 87, 104, 121, 63]],
    "attention_mask": [[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]],
}


def test_paged_cache_under_tp_plan_matches_dynamic_cache_and_single_process(tmp_path):
    model = tiny_model("llama", seed=5, num_heads=4, num_kv_heads=2)
    model.save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    inputs = {name: torch.tensor(value) for name, value in BATCH.items()}
    single = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=255)
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(WORKER), str(tmp_path / "model"), str(out), json.dumps(BATCH)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tp_size"] == 2 and report["pool_kv_heads"] == 1  # each rank pools its own KV head
    assert report["dynamic"] == single.tolist()
    assert report["sdpa"] == report["paged_backend"] == report["dynamic"]
    assert report["sdpa_blocks_back"] and report["paged_backend_blocks_back"]


def test_kv_heads_that_do_not_split_over_the_ranks_are_refused():
    import pytest

    from paged_backend.errors import UnsupportedModel
    from paged_backend.hf.model_support import KVGeometry, rank_geometry

    with pytest.raises(UnsupportedModel, match="3 KV heads.*size 2"):
        rank_geometry(KVGeometry(2, 3, 16, (None, None)), 2)
    # tp_plan chunks every projection evenly, so the engine's replication of fewer heads than ranks is refused too.
    with pytest.raises(UnsupportedModel, match="2 KV heads.*size 4"):
        rank_geometry(KVGeometry(2, 2, 16, (None, None)), 4)
    assert rank_geometry(KVGeometry(2, 4, 16, (None, None)), None).num_kv_heads == 4
