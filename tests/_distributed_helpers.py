"""Shared pieces of the scale-out tests: three tiny models saved to directories, their HF greedy reference, and the
checks every case ends with (blocks all free, no child process left).

Near-ties: a TP rank sums partial products in another order than one process does, so fp32 logits differ in
the last bits. The seeds below were picked so that every greedy step of every prompt has a top-1/top-2 logit
margin of at least 1e-3 (`reference` asserts at least 5e-4), three orders above that noise: no flip is possible.
That argument is about float32, as is the HF reference, so the engines compared with it run with `dtype=DTYPE`
(`--dtype auto` is bfloat16 on CPUs with AMX or AVX512-BF16).
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path

import psutil
import torch

from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker.models import byte_tokenizer, tiny_model

# name -> (architecture, KV heads, seed); 4 query heads each, so TP=2 splits KV heads 2 -> 1 and replicates 1.
MODELS = {
    "llama-gqa": ("llama", 2, 0), "llama-kv1": ("llama", 1, 2), "qwen2": ("qwen2", 2, 2), "qwen3": ("qwen3", 2, 2),
}  # fmt: skip
DTYPE = "float32"  # the engines' dtype wherever they are compared with `reference` (HF, float32)
MIN_MARGIN = 5e-4
MAX_TOKENS = 12
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(253) for _ in range(_rng.randint(3, 20))] for _ in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def save_models(root: Path) -> dict[str, str]:
    """Each model and the byte tokenizer saved under `root`; returns name -> directory."""
    dirs = {}
    for name, (arch, kv_heads, seed) in MODELS.items():
        path = root / name
        tiny_model(arch, seed=seed, num_kv_heads=kv_heads).save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
        dirs[name] = str(path)
    return dirs


@torch.no_grad()
def reference(name: str) -> list[list[int]]:
    """HF generate (sdpa, DynamicCache) greedy tokens per prompt, after asserting the logit margin premise."""
    arch, kv_heads, seed = MODELS[name]
    model = tiny_model(arch, seed=seed, num_kv_heads=kv_heads)
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)  # fmt: skip
        for scores in out.scores:
            top = scores[0].topk(2).values
            assert top[0] - top[1] > MIN_MARGIN, f"{name}: a near-tie; pick another seed"
        outputs.append(out.sequences[0, len(prompt) :].tolist())
    return outputs


def generate(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


def close_and_check(llm: LLM) -> None:
    """Every block free again, the worker ranks stopped, no child process or process-group thread left behind."""
    manager = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_blocks - 1
    llm.engine.close()
    assert_no_children()
    assert_groups_closed()


def assert_groups_closed() -> None:
    """No gloo thread (transport loop or collective worker) left in this process: one left to interpreter exit can
    abort the process while it releases a collective's tensors."""
    assert not gloo_threads(), f"the closed engine's process groups still run threads: {gloo_threads()}"


def gloo_threads() -> list[str]:
    """This process's gloo threads, by name."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended since the listing
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
    return sorted(name for name in names if "gloo" in name)


OTHER_LAUNCHES: set[int] = set()  # pids of launchers a test started on purpose (torchrun nodes) and their trees


def is_multiprocessing_helper(process: psutil.Process, root: int) -> bool:
    """multiprocessing's own fork server and resource tracker (children of `root` itself): they live as long as
    the interpreter that started them and leave with it, so they are no engine's leftovers. Worker ranks fork
    from the fork server, so they share its command line but are its children, not `root`'s."""
    try:
        command = " ".join(process.cmdline())
        parent = process.ppid()
    except psutil.NoSuchProcess:
        return False
    helper = "multiprocessing.forkserver" in command or "multiprocessing.resource_tracker" in command
    return helper and parent == root


def engine_processes(root: int | None = None) -> list[psutil.Process]:
    """Processes the engines of `root` (default: this test process) started: its descendants outside
    `OTHER_LAUNCHES`, less multiprocessing's helpers."""
    root = root or os.getpid()
    found = []
    for child in psutil.Process(root).children(recursive=True):
        try:  # a short-lived process may exit between the listing and these reads: it is no engine worker
            if not ({child.pid} | {parent.pid for parent in child.parents()}) & OTHER_LAUNCHES and not (
                is_multiprocessing_helper(child, root)
            ):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def assert_no_children(timeout: float = 10.0) -> None:
    """No process an engine of this test process started is still alive."""
    _, alive = psutil.wait_procs(engine_processes(), timeout=timeout)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {alive}"
