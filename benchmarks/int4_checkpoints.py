"""AWQ and GPTQ int4 checkpoints on CPU against the dense model they were made from, in one run.

Builds a seeded synthetic Llama (hidden 1024, 8 layers, vocab 32000), saves it dense (bfloat16) and as AWQ (GEMM)
and GPTQ int4 checkpoints (group 128, round-to-nearest, packed by tests/_int4_checkpoints.py), the GPTQ one also
with act-order (its groups are not consecutive channels, so it is dequantized). Each variant then runs in a fresh
process: its weight bytes, decode tokens/s at 1 and 8 streams through `LLM.generate` (time for N new tokens less
time for 1, so prefill is left out), and the process RSS once it has decoded (every weight page touched; dense
checkpoints are memory-mapped, so RSS right after `LLM(dir)` would miss pages not yet read), with the part of it
that loading and decoding added (the process's libraries left out). The variants alternate over `--rounds`
processes each; the table keeps each one's best.

    python benchmarks/int4_checkpoints.py --threads 2
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkpoint builder lives with the tests

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=4, vocab_size=32000)
GROUP_SIZE = 128
MIB = 1 << 20
VARIANTS = [  # (label, checkpoint, dtype)
    ("dense bf16", "dense", "bfloat16"),
    ("dense fp32", "dense", "float32"),
    ("AWQ int4 repacked, bf16", "awq", "bfloat16"),
    ("AWQ int4 repacked, fp32", "awq", "float32"),
    ("GPTQ int4 repacked, bf16", "gptq", "bfloat16"),
    ("GPTQ act-order, dequantized to bf16", "gptq-act-order", "bfloat16"),
    ("GPTQ act-order, dequantized to fp32", "gptq-act-order", "float32"),
]


def build(folder: Path) -> None:
    from paged_backend.worker.models import byte_tokenizer, tiny_model
    from tests._int4_checkpoints import build_checkpoint

    tiny_model("llama", seed=0, **SHAPE).to(torch.bfloat16).save_pretrained(folder / "dense")
    byte_tokenizer().save_pretrained(folder / "dense")
    for name, options in {"awq": dict(method="awq"), "gptq": dict(method="gptq"),
                          "gptq-act-order": dict(method="gptq", desc_act=True)}.items():  # fmt: skip
        build_checkpoint(folder / name, seed=0, group_size=GROUP_SIZE, shape=SHAPE, **options)
        gc.collect()


def seconds(llm, prompts: list[list[int]], tokens: int) -> float:
    """Wall time of one greedy `LLM.generate` of `tokens` new tokens per prompt."""
    from paged_backend.engine import SamplingParams

    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return time.perf_counter() - start


def measure(path: str, dtype: str, threads: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    """One variant, in this process: RSS after loading, decode tok/s at 1 and 8 streams, then its weight bytes."""
    import psutil

    from paged_backend.engine import LLM
    from paged_backend.worker.models import load_model
    from paged_backend.worker.quantization import weight_bytes

    torch.set_num_threads(threads)
    process = psutil.Process()
    before = process.memory_info().rss
    llm = LLM(path, dtype=dtype, device="cpu", num_blocks=128, block_size=16, max_num_seqs=8)
    result = {}
    generator = torch.Generator().manual_seed(0)
    for streams in (1, 8):
        prompts = [torch.randint(0, SHAPE["vocab_size"], (prompt_len,), generator=generator).tolist()
                   for _ in range(streams)]  # fmt: skip

        seconds(llm, prompts, 2)  # warm-up
        best = min(seconds(llm, prompts, new_tokens) - seconds(llm, prompts, 1) for _ in range(repeats))
        result[f"tok_s_{streams}"] = streams * (new_tokens - 1) / best
    result["rss_mib"] = process.memory_info().rss / MIB  # every weight page touched by now (dense ones are mmapped)
    result["model_rss_mib"] = result["rss_mib"] - before / MIB  # what loading and decoding added to the process
    del llm
    gc.collect()
    model, _ = load_model(path, dtype=dtype, device="cpu")  # the engine prepacks dense layers: count a plain load
    result["weight_mib"] = weight_bytes(model) / MIB
    return result


def run_variant(folder: str, checkpoint: str, dtype: str, args: argparse.Namespace) -> tuple[dict, str]:
    """One variant in a fresh process (so its RSS is its own): its measurements and its startup line."""
    command = [sys.executable, __file__, "--measure", f"{folder}/{checkpoint}", dtype, "--threads", str(args.threads),
               "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    startup = [line for line in done.stderr.splitlines() if "int4 checkpoint on CPU" in line]
    return json.loads(done.stdout.strip().splitlines()[-1]), startup[0] if startup else "dense checkpoint"


def best_of(runs: list[dict]) -> dict:
    """Per measure, the best of the rounds: the highest tok/s, the lowest RSS (the box is shared)."""
    return {key: (max if key.startswith("tok_s") else min)(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=33)
    parser.add_argument("--repeats", type=int, default=2, help="timed generates per stream count, in each process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per variant, the variants alternating")
    parser.add_argument("--measure", nargs=2, metavar=("DIR", "DTYPE"), help=argparse.SUPPRESS)  # one variant
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args.threads, args.prompt_len, args.new_tokens, args.repeats)))
        return
    runs = {label: [] for label, _, _ in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="int4-bench-") as folder:
        build(Path(folder))
        for round_ in range(args.rounds):
            for label, checkpoint, dtype in VARIANTS:
                result, startup = run_variant(folder, checkpoint, dtype, args)
                runs[label].append(result)
                if round_ == 0:
                    print(f"{label}: {startup}", file=sys.stderr)
    rows = {label: best_of(results) for label, results in runs.items()}
    base = rows["dense bf16"]
    params = SHAPE["vocab_size"] * SHAPE["hidden_size"] * 2  # embeddings + lm_head stay dense in every variant
    print(f"llama {SHAPE}, int4 group {GROUP_SIZE}; embeddings + lm_head ({params / 1e6:.0f}M params) stay dense; "
          f"{args.threads} threads, {args.prompt_len}-token prompts, decode tok/s over {args.new_tokens - 1} tokens; "
          f"best of {args.rounds} processes x {args.repeats} runs")  # fmt: skip
    print("| variant | weights MiB | process RSS MiB | RSS added by the model MiB | decode tok/s, 1 stream "
          "| decode tok/s, 8 streams |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for label, row in rows.items():
        print(
            f"| {label} | {row['weight_mib']:.0f} ({row['weight_mib'] / base['weight_mib']:.2f}x) "
            f"| {row['rss_mib']:.0f} ({row['rss_mib'] / base['rss_mib']:.2f}x) "
            f"| {row['model_rss_mib']:.0f} ({row['model_rss_mib'] / base['model_rss_mib']:.2f}x) "
            f"| {row['tok_s_1']:.1f} ({row['tok_s_1'] / base['tok_s_1']:.2f}x) "
            f"| {row['tok_s_8']:.1f} ({row['tok_s_8'] / base['tok_s_8']:.2f}x) |"
        )


if __name__ == "__main__":
    main()
