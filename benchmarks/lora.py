"""LoRA serving throughput: 32 requests spread over 0, 1, 4 and 8 adapters, in one run.

Three ways to serve the same requests (greedy, EOS ignored, equal output lengths):
- mixed: one `LLM.generate` over all 32 requests; every step mixes adapters and the base model (ours);
- groups: one `LLM.generate` per adapter group, one after another (the same engine, no mixing);
- peft: peft's own `generate` per adapter group (`set_adapter`, a padded batch), one after another.
Adapters are random peft adapters of rank 8 on every attention and MLP projection (the costliest case).

    python benchmarks/lora.py                 # embedded-size Llama (hidden 256, 4 layers), CPU, a few minutes
"""

from __future__ import annotations

import argparse
import copy
import random
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from paged_backend.engine import LLM, SamplingParams
from paged_backend.lora import LoRARequest
from paged_backend.worker.models import EMBEDDED_SHAPE, byte_tokenizer, tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--adapter-counts", default="0,1,4,8")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is stable on a shared box)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per cell (a shared box)")
    return parser.parse_args()


def base_model():
    shape = {k: v for k, v in EMBEDDED_SHAPE.items()}
    return tiny_model("llama", seed=1234, **shape)


def save_adapters(root: Path, count: int, rank: int) -> dict[str, Path]:
    base, adapters = base_model(), {}
    for index in range(count):
        torch.manual_seed(index)
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                                     init_lora_weights=False))  # fmt: skip
        adapters[f"a{index}"] = root / f"a{index}"
        peft_model.save_pretrained(adapters[f"a{index}"])
    return adapters


def assignment(num_requests: int, names: list[str]) -> list[str | None]:
    """Adapter of each request: round-robin over the names (all base when there are none)."""
    return [names[i % len(names)] if names else None for i in range(num_requests)]


def run_mixed(llm: LLM, prompts, owners, loras, params, clock=time.perf_counter) -> tuple[float, int]:
    started = clock()
    outputs = llm.generate(prompts, params, lora_request=[loras.get(o) for o in owners])
    return clock() - started, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_groups(llm: LLM, prompts, owners, loras, params) -> tuple[float, int]:
    started, tokens = time.perf_counter(), 0
    for owner in dict.fromkeys(owners):
        group = [p for p, o in zip(prompts, owners, strict=True) if o == owner]
        outputs = llm.generate(group, params, lora_request=loras.get(owner))
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return time.perf_counter() - started, tokens


def run_peft(adapters: dict[str, Path], prompts, owners, max_tokens: int) -> tuple[float, int]:
    model = base_model()
    if adapters:
        names = list(adapters)
        model = PeftModel.from_pretrained(model, str(adapters[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(str(adapters[name]), adapter_name=name)
    started, tokens = time.perf_counter(), 0
    for owner in dict.fromkeys(owners):
        group = torch.tensor([p for p, o in zip(prompts, owners, strict=True) if o == owner])
        if owner is not None:
            model.set_adapter(owner)
        with torch.no_grad():
            out = model.generate(input_ids=group, attention_mask=torch.ones_like(group), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False)  # fmt: skip
        tokens += (out.shape[1] - group.shape[1]) * len(group)
    return time.perf_counter() - started, tokens


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    counts = [int(c) for c in args.adapter_counts.split(",")]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    all_adapters = save_adapters(root, max(counts), args.rank)
    llm = LLM(base_model(), tokenizer=byte_tokenizer(), enable_lora=True, max_loras=max(1, max(counts)),
              max_lora_rank=args.rank, num_blocks=512, max_num_seqs=args.num_requests)  # fmt: skip
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(all_adapters.items())}
    llm.generate(prompts[:2], params)  # warm-up
    rows, base_rate = [], None
    for count in counts:
        names = list(all_adapters)[:count]
        owners = assignment(args.num_requests, names)
        adapters = {n: all_adapters[n] for n in names}
        runs = [
            partial(run_mixed, llm, prompts, owners, loras, params),
            partial(run_groups, llm, prompts, owners, loras, params),
            partial(run_peft, adapters, prompts, owners, args.max_tokens),
        ]
        # The mixed run once more on the process's CPU clock (1 thread): less sensitive to a busy shared box.
        runs.append(partial(run_mixed, llm, prompts, owners, loras, params, time.process_time))
        rates = [max(tokens / seconds for seconds, tokens in (run() for _ in range(args.repeats))) for run in runs]
        base_rate = base_rate or rates
        rows.append((count, *rates[:3], rates[0] / base_rate[0], rates[3] / base_rate[3]))
    print(
        f"{args.num_requests} requests, prompt {args.prompt_len}, {args.max_tokens} output tokens, rank {args.rank}, "
        f"best of {args.repeats}"
    )
    print(
        "| adapters | mixed tok/s (ours) | groups in sequence tok/s | peft generate per group tok/s "
        "| mixed / base-only (wall) | mixed / base-only (CPU time) | mixed / groups | mixed / peft |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for count, mixed, groups, peft, vs_base, vs_base_cpu in rows:
        print(
            f"| {count} | {mixed:.0f} | {groups:.0f} | {peft:.0f} | {vs_base:.2f} | {vs_base_cpu:.2f} "
            f"| {mixed / groups:.2f} | {mixed / peft:.2f} |"
        )


if __name__ == "__main__":
    main()
