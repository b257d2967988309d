"""Paged decode attention vs contiguous KV: time, achieved KV bandwidth, and ratios to the baselines.

GPU (default when CUDA is visible): Llama-3-8B geometry (32 q heads, 8 kv heads, head dim 128, bf16),
batch {1, 8, 64, 256} x context {512, 2k, 8k, 32k}. Rows: the cuda and triton backends on shuffled block
tables, torch SDPA on the same tokens stored contiguously, and FlashInfer's paged decode when importable.
Bandwidth = K+V bytes read / kernel time; % of peak uses the GPU's HBM bandwidth (H100 3.35 TB/s,
H200 4.8 TB/s, detected by name; --peak-tbps overrides).

CPU (--device cpu): the fused cpu kernel and the torch oracle, paged, against SDPA on contiguous KV, float32 (or
--cpu-dtype bfloat16 or float16, prefill table included). Each decode row also times a sequential sum over a buffer of
the same bytes (best of the same calls): the streaming bound a pass over that much memory meets on this core, and the
kernel's share of it. Beside it, a bare read of the same blocks in the tables' order, each front to back
(`ops.cpu.read_blocks`: no math, no software prefetch, so the kernel, which asks for its blocks ahead, can pass it):
what scattered blocks stream at, below a sequential pass, the more so the fewer bytes a block holds. And it times the
kernel on the same batch with a block table that cycles over a few blocks, which stay in the core's cache: the rate
its arithmetic allows. Below the streaming bound, the kernel is compute-bound at that shape. The pools lie on ordinary
pages, as the engine's do by default; a last column times a copy on 2 MiB pages (what PAGED_BACKEND_KV_HUGE_PAGES=1
gives the engine, core/huge_pages.py). On CPUs with AMX, bf16 decode runs on the tiles (csrc/cpu/attention_tiles.h); a
column times the same calls on the AVX-512 path it replaces.
--cpu-kv-dtype fp8_e4m3 (or fp8_e5m2) stores the pools in fp8 under a scale, read with the query in --cpu-dtype; the
contiguous baseline reads the same values in the query's dtype, and bandwidth counts the pool's bytes.
--geometry smollm2-135m uses the real model's heads (9 q, 3 kv, dim 64) instead of Llama-3-8B's. --tables engine lays
the tables out as the engine's BlockManager does on a pool that has served a batch before (engine_tables), instead of
shuffling every block: the layout the kernel meets in serving, where --tables shuffled is its worst case.

    python benchmarks/attention.py                            # GPU grid
    python benchmarks/attention.py --device cpu --threads 1 --output cpu.md
    python benchmarks/attention.py --device cpu --threads 1 --batch 1 8 64 --context 512 2048 16384
    python benchmarks/attention.py --device cpu --threads 1 --cpu-dtype bfloat16 --cpu-kv-dtype fp8_e4m3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged_backend import ops
from paged_backend.core import huge_pages
from paged_backend.core.block_manager import BlockManager
from paged_backend.ops import cpu as cpu_ops

GEOMETRIES = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # q heads, kv heads, head dim
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = GEOMETRIES["llama3-8b"]
TABLES = "shuffled"  # or "engine" (--tables)
DECODED = 256  # --tables engine: tokens each sequence decodes after its prompt (--decoded)
KV_DTYPE: torch.dtype | None = None  # the pools' dtype where it is not the query's (--cpu-kv-dtype)
KV_SCALE = 0.05  # an fp8 pool holds K / KV_SCALE and V / KV_SCALE (as --calculate-kv-scales would set a scale)
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
PEAK_TBPS_BY_NAME = (("H200", 4.8), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100", 2.0))


@dataclass
class DecodeBatch:
    query: torch.Tensor  # [B, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, ctx // block_size], a random permutation of the non-null blocks
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    contiguous_key: torch.Tensor  # [B, Hkv, ctx, D], the same tokens in order
    contiguous_value: torch.Tensor

    @property
    def kv_bytes(self) -> int:
        return 2 * self.contiguous_key.numel() * self.key_cache.element_size()


def make_batch(batch: int, context: int, block_size: int, dtype: torch.dtype, device: str) -> DecodeBatch:
    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq + 1  # block 0 is the null block
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    if KV_DTYPE is not None:
        key_cache, value_cache = ((pool.float() / KV_SCALE).to(KV_DTYPE) for pool in (key_cache, value_cache))
    if TABLES == "engine":
        tables = engine_tables(batch, context, block_size).to(device)
    else:
        perm = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
        tables = perm.view(batch, blocks_per_seq).to(torch.int32)

    def contiguous(pool: torch.Tensor) -> torch.Tensor:  # in the query's dtype: an fp8 pool's values times its scale
        tokens = pool[tables.long()].view(batch, context, NUM_KV_HEADS, HEAD_DIM)
        if KV_DTYPE is not None:
            tokens = (tokens.float() * KV_SCALE).to(dtype)
        return tokens.transpose(1, 2).contiguous()

    return DecodeBatch(
        query=torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        contiguous_key=contiguous(key_cache),
        contiguous_value=contiguous(value_cache),
    )


def engine_tables(batch: int, context: int, block_size: int) -> torch.Tensor:
    """Block tables as the engine's BlockManager lays them out on a pool that has served before. A first batch of
    requests of random lengths is allocated and finishes in random order (its full blocks stay cached, so they go
    back to the free queue tail first). Then the measured batch: each request allocates its prompt of
    `context - DECODED` tokens in turn, and all of them decode the rest a token a step, the way continuous batching
    grows them."""
    manager = BlockManager(batch * (context // block_size) + 1, block_size)
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1 << 30) for _ in range(n)]

    for seq in range(batch):
        n = rng.randint(1, context)
        manager.allocate(("earlier", seq), tokens(n))
        manager.commit(("earlier", seq), n)
    for seq in rng.sample(range(batch), batch):
        manager.free(("earlier", seq))
    decoded = min(DECODED, context - 1)
    for seq in range(batch):
        manager.allocate(seq, tokens(context - decoded))
    for _ in range(decoded):
        for seq in range(batch):
            manager.append_slots(seq, tokens(1))
    return torch.tensor([manager.block_table(seq) for seq in range(batch)], dtype=torch.int32)


def time_all(fns: dict[str, Callable[[], object]], device: str, iters: int) -> dict[str, float]:
    """Milliseconds per call of each function, calls interleaved so load changes hit all of them alike.

    GPU: median of CUDA-event timings. CPU: best wall clock, since other processes only ever add time.
    """
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end))
            else:
                begin = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - begin) * 1e3)
    pick = statistics.median if device == "cuda" else min
    return {name: pick(values) for name, values in samples.items()}


RESIDENT_BLOCKS = 8  # the blocks a cache-resident run cycles over: 1 MiB of fp32 K+V at Llama-3-8B's heads


def cache_resident(b: DecodeBatch) -> DecodeBatch:
    """`b` with every sequence reading blocks 1..RESIDENT_BLOCKS (or all the pool has) over and over: the same
    work, from cache."""
    tables = torch.arange(b.block_tables.numel(), dtype=torch.int32, device=b.block_tables.device)
    blocks = min(RESIDENT_BLOCKS, b.key_cache.shape[0] - 1)  # (block 0 is the null block)
    return dataclasses.replace(b, block_tables=(tables % blocks + 1).view_as(b.block_tables))


def on_huge_pages(b: DecodeBatch) -> DecodeBatch | None:
    """`b` with its pools copied to 2 MiB pages; None where the kernel offers none."""
    if not huge_pages.huge_pages_offered():
        return None
    key_cache, value_cache = (huge_pages.zeros(tuple(pool.shape), pool.dtype).copy_(pool)
                              for pool in (b.key_cache, b.value_cache))  # fmt: skip
    return dataclasses.replace(b, key_cache=key_cache, value_cache=value_cache)


def block_order_read(b: DecodeBatch) -> Callable[[], int]:
    """A bare read of the batch's blocks in its tables' order, each block front to back: what scattered blocks stream
    at (below a sequential pass: the hardware prefetchers restart at each)."""
    blocks = b.block_tables.flatten().contiguous()
    return lambda: cpu_ops.read_blocks(b.key_cache, b.value_cache, blocks)


def without_amx(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`fn` on the AVX-512 path: AMX tiles off for the call, on again after."""

    def call() -> torch.Tensor:
        cpu_ops.amx_tiles(False)
        try:
            return fn()
        finally:
            cpu_ops.amx_tiles(True)

    return call


def kv_scales() -> dict[str, float]:
    scale = 1.0 if KV_DTYPE is None else KV_SCALE
    return {"k_scale": scale, "v_scale": scale}


def paged(b: DecodeBatch, backend: str) -> Callable[[], torch.Tensor]:
    scale = HEAD_DIM**-0.5
    return lambda: ops.paged_attention(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                       b.query_start_loc, scale, backend=backend, **kv_scales())


def sdpa_contiguous(b: DecodeBatch) -> Callable[[], torch.Tensor]:
    # the q heads of one kv head become its query rows: exact for decode (no mask) and no K/V head repeat
    batch = b.query.shape[0]
    query = b.query.view(batch, NUM_KV_HEADS, NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM)
    return lambda: F.scaled_dot_product_attention(query, b.contiguous_key, b.contiguous_value)


def flashinfer_paged(b: DecodeBatch) -> Callable[[], torch.Tensor] | None:
    try:
        import flashinfer
    except ImportError:
        return None
    batch, blocks_per_seq = b.block_tables.shape
    block_size = b.key_cache.shape[1]
    device = b.query.device
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    try:
        wrapper.plan(
            torch.arange(batch + 1, dtype=torch.int32, device=device) * blocks_per_seq,
            b.block_tables.flatten(),
            torch.full((batch,), block_size, dtype=torch.int32, device=device),
            NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, block_size,
            q_data_type=b.query.dtype, kv_data_type=b.key_cache.dtype,
        )
    except (TypeError, RuntimeError) as exc:  # an installed FlashInfer whose plan() differs: leave it out
        print(f"flashinfer left out: {exc}", file=sys.stderr)
        return None
    return lambda: wrapper.run(b.query, (b.key_cache, b.value_cache))


def peak_tbps(override: float | None) -> float | None:
    if override:
        return override
    name = torch.cuda.get_device_name()
    return next((tbps for key, tbps in PEAK_TBPS_BY_NAME if key in name), None)


def fits_in_memory(batch: int, context: int, dtype: torch.dtype, device: str) -> bool:
    """Whether a cell's tensors fit in a quarter-headroom share of the device's free memory. GPU: the pools, the
    contiguous copy of K and V and one gather temporary (~5x the K or V bytes). CPU: also the fp32 randn they are
    drawn from, the summed stream and the pools' copy on huge pages (~14x)."""
    kv = batch * context * NUM_KV_HEADS * HEAD_DIM * torch.empty((), dtype=dtype).element_size()
    if device == "cuda":
        needed, free = 5 * kv, torch.cuda.mem_get_info()[0]
    else:
        needed, free = 14 * kv, os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return needed < 0.75 * free


def gpu_cells(b: DecodeBatch, args: argparse.Namespace, peak: float | None) -> list:
    fns = {"cuda": paged(b, "cuda"), "triton": paged(b, "triton"), "sdpa": sdpa_contiguous(b)}
    flashinfer = flashinfer_paged(b)
    if flashinfer:
        fns["flashinfer"] = flashinfer
    times = time_all(fns, "cuda", args.iters)
    fi_ms = times.pop("flashinfer", None)
    gbps = {name: b.kv_bytes / (ms * 1e-3) / 1e9 for name, ms in times.items()}
    batch, context = b.block_tables.shape[0], int(b.seq_lens[0])
    return [
        batch, context, f"{b.kv_bytes / 2**20:.0f}",
        f"{times['cuda']:.3f}", f"{gbps['cuda']:.0f}", f"{100 * gbps['cuda'] / (peak * 1e3):.0f}%" if peak else "n/a",
        f"{times['triton']:.3f}", f"{gbps['triton']:.0f}",
        f"{times['sdpa']:.3f}", f"{times['cuda'] / times['sdpa']:.2f}", f"{times['triton'] / times['sdpa']:.2f}",
        f"{fi_ms:.3f}" if fi_ms else "n/a", f"{times['cuda'] / fi_ms:.2f}" if fi_ms else "n/a",
    ]


def gpu_table(args: argparse.Namespace) -> list[str]:
    dtype = torch.bfloat16
    peak = peak_tbps(args.peak_tbps)
    header = ["batch", "context", "KV MiB", "cuda ms", "cuda GB/s", "cuda % peak", "triton ms", "triton GB/s",
              "sdpa contiguous ms", "cuda / sdpa", "triton / sdpa", "flashinfer ms", "cuda / flashinfer"]
    lines = [f"GPU: {torch.cuda.get_device_name()}, peak {peak or 'unknown'} TB/s; ratios are time / time "
             "(below 1: the paged kernel is faster)", "", _row(header), _row(["---"] * len(header))]
    for batch in args.batch:
        for context in args.context:
            if not fits_in_memory(batch, context, dtype, "cuda"):
                lines.append(_row([batch, context, "skipped: does not fit in free GPU memory"]))
                continue
            lines.append(_row(gpu_cells(make_batch(batch, context, args.block_size, dtype, "cuda"), args, peak)))
            torch.cuda.empty_cache()
    return lines


def cpu_table(args: argparse.Namespace) -> list[str]:
    dtype = getattr(torch, args.cpu_dtype)
    header = ["batch", "context", "KV MiB", "cpu kernel ms", "torch oracle ms", "sdpa contiguous ms",
              "cpu / contiguous", "oracle / contiguous", "cpu kernel GB/s", "sequential sum GB/s", "cpu % of sum",
              "block-order read GB/s", "cpu % of block-order read", "cpu cache-resident GB/s",
              "cpu on 2 MiB pages GB/s", "cpu AVX-512 path GB/s (AMX off)"]
    amx = tiles_run(dtype)  # time the path the tiles replace too
    lines = [f"CPU, {pools_named(args)}, {NUM_Q_HEADS} q / {NUM_KV_HEADS} kv heads, head dim {HEAD_DIM}, "
             f"{torch.get_num_threads()} threads, best of {args.iters}; {table_layout()}, block size "
             f"{args.block_size}", "", _row(header), _row(["---"] * len(header))]
    for batch in args.batch:
        for context in args.context:
            if not fits_in_memory(batch, context, dtype, "cpu"):
                lines.append(_row([batch, context, "skipped: does not fit in free memory"]))
                continue
            b = make_batch(batch, context, args.block_size, dtype, "cpu")
            stream = torch.randn(b.kv_bytes // 4)  # the same bytes, read front to back
            candidates = {"cpu": paged(b, "cpu"), "torch": paged(b, "torch"), "sdpa": sdpa_contiguous(b),
                          "sum": stream.sum, "resident": paged(cache_resident(b), "cpu"),
                          "blocks": block_order_read(b)}
            huge = on_huge_pages(b)
            if huge is not None:
                candidates["huge pages"] = paged(huge, "cpu")
            if amx:
                candidates["avx-512"] = without_amx(candidates["cpu"])
            times = time_all(candidates, "cpu", args.iters)
            cpu_ms, torch_ms, sdpa_ms, sum_ms = times["cpu"], times["torch"], times["sdpa"], times["sum"]
            lines.append(_row([batch, context, f"{b.kv_bytes / 2**20:.0f}", f"{cpu_ms:.2f}", f"{torch_ms:.2f}",
                               f"{sdpa_ms:.2f}", f"{cpu_ms / sdpa_ms:.2f}", f"{torch_ms / sdpa_ms:.2f}",
                               f"{b.kv_bytes / cpu_ms / 1e6:.1f}", f"{b.kv_bytes / sum_ms / 1e6:.1f}",
                               f"{100 * sum_ms / cpu_ms:.0f}%", f"{b.kv_bytes / times['blocks'] / 1e6:.1f}",
                               f"{100 * times['blocks'] / cpu_ms:.0f}%", f"{b.kv_bytes / times['resident'] / 1e6:.1f}",
                               f"{b.kv_bytes / times['huge pages'] / 1e6:.1f}" if huge is not None else "n/a",
                               f"{b.kv_bytes / times['avx-512'] / 1e6:.1f}" if amx else "n/a"]))
            del b, stream, huge
    return lines


def prefill_calls(batch: int, prompt: int, block_size: int,
                  dtype: torch.dtype) -> dict[str, Callable[[], torch.Tensor]]:
    """Every token of `batch` prompts attends causally: paged (cpu kernel, oracle) and contiguous SDPA."""
    b = make_batch(batch, prompt, block_size, dtype, "cpu")
    query = torch.randn(batch * prompt, NUM_Q_HEADS, HEAD_DIM).to(dtype)
    starts = torch.arange(batch + 1, dtype=torch.int32) * prompt
    dense_query = query.view(batch, prompt, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
    scale = HEAD_DIM**-0.5

    def paged_prefill(backend: str) -> Callable[[], torch.Tensor]:
        return lambda: ops.paged_attention(query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, starts,
                                           scale, backend=backend, **kv_scales())

    def sdpa_causal() -> torch.Tensor:
        return F.scaled_dot_product_attention(dense_query, b.contiguous_key, b.contiguous_value, is_causal=True,
                                              enable_gqa=True)

    calls = {"cpu": paged_prefill("cpu"), "torch": paged_prefill("torch"), "sdpa": sdpa_causal}
    if tiles_run(dtype):
        calls["avx-512"] = without_amx(calls["cpu"])
    return calls


def cpu_prefill_table(args: argparse.Namespace) -> list[str]:
    dtype = getattr(torch, args.cpu_dtype)
    amx = tiles_run(dtype)
    header = ["batch", "prompt", "cpu kernel ms", "torch oracle ms", "sdpa causal ms", "cpu / sdpa", "oracle / sdpa",
              "cpu AVX-512 path ms (AMX off)"]
    lines = ["", f"Prefill (causal, q_len = prompt length, {pools_named(args)}):", "", _row(header),
             _row(["---"] * len(header))]
    for batch, prompt in ((1, 512), (4, 512)):
        times = time_all(prefill_calls(batch, prompt, args.block_size, dtype), "cpu", args.iters)
        lines.append(_row([batch, prompt, f"{times['cpu']:.2f}", f"{times['torch']:.2f}", f"{times['sdpa']:.2f}",
                           f"{times['cpu'] / times['sdpa']:.2f}", f"{times['torch'] / times['sdpa']:.2f}",
                           f"{times['avx-512']:.2f}" if amx else "n/a"]))
    return lines


def tiles_run(dtype: torch.dtype) -> bool:
    """Whether the kernel runs a query of `dtype` on AMX tiles here: bf16 over bf16 or fp8 pools."""
    return dtype == torch.bfloat16 and cpu_ops.amx_tiles()


def pools_named(args: argparse.Namespace) -> str:
    if KV_DTYPE is None:
        return args.cpu_dtype
    return f"{args.cpu_dtype} query, {args.cpu_kv_dtype} pools (scale {KV_SCALE})"


def table_layout() -> str:
    if TABLES == "engine":
        return f"block tables laid out by the engine's BlockManager ({DECODED} tokens decoded after each prompt)"
    return "shuffled block tables"


def _row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> None:
    global NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, TABLES, DECODED, KV_DTYPE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--context", type=int, nargs="+", default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=None, help="timed calls per cell (median reported)")
    parser.add_argument("--peak-tbps", type=float, default=None, help="HBM bandwidth in TB/s for %% of peak")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (torch.set_num_threads); 1 keeps timings stable on a shared machine")
    parser.add_argument("--output", default=None, help="also write the markdown table to this file")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="llama3-8b", help="attention heads")
    parser.add_argument("--cpu-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="query and KV dtype of the CPU decode and prefill tables")
    parser.add_argument("--cpu-kv-dtype", choices=["same", *FP8_DTYPES], default="same",
                        help="the CPU pools' dtype: the query's (--cpu-dtype), or fp8 under a scale")
    parser.add_argument("--no-prefill", action="store_true", help="CPU: leave out the prefill table")
    parser.add_argument("--tables", choices=["shuffled", "engine"], default="shuffled",
                        help="decode block tables: every block shuffled, or as the engine's BlockManager lays them out")
    parser.add_argument("--decoded", type=int, default=DECODED,
                        help="--tables engine: tokens each sequence decodes after its prompt")
    args = parser.parse_args()
    NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = GEOMETRIES[args.geometry]
    TABLES, DECODED = args.tables, args.decoded
    on_gpu = args.device == "cuda"
    KV_DTYPE = None if on_gpu else FP8_DTYPES.get(args.cpu_kv_dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.batch = args.batch or ([1, 8, 64, 256] if on_gpu else [1, 8])
    args.context = args.context or ([512, 2048, 8192, 32768] if on_gpu else [512, 2048])
    args.iters = args.iters or (20 if on_gpu else 10)

    if on_gpu:
        text = "\n".join(gpu_table(args))
    else:
        text = "\n".join(cpu_table(args) + ([] if args.no_prefill else cpu_prefill_table(args)))
    print(text)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
