"""Batch-invariant mode (`--batch-invariant`): one request's tokens and logprobs are bitwise the same alone and
inside a batch of 32 others with mixed lengths, under chunked prefill, a prefix-cache hit and a recompute
preemption, through `LLM` (fp32, and bf16 where the CPU packs it) and a real `serve`; re-scored with prompt logprobs
(echo), the same text gives exactly the logprobs it was sampled with. Then the parts one by one (linear tiles,
activations, the attention kernel's invariant path, the sampler), and the default mode left as it was.
"""

from __future__ import annotations

import asyncio
import random
from functools import cache

import pytest
import torch
from torch import nn

from paged_backend import ops
from paged_backend.config import BATCH_INVARIANT_ENV, EngineConfig
from paged_backend.engine import LLM, SamplingParams
from paged_backend.engine.args import EngineArgs
from paged_backend.engine.sampler import Sampler
from paged_backend.errors import BackendUnavailable, InvalidRequest
from paged_backend.ops import cpu
from paged_backend.worker.batch_invariant import BatchInvariantLinears, tiled_elementwise
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.packed_linear import PackedLinears, packs
from tests._ops_cases import FP8
from tests._server_helpers import server_fixture

SHARED = [(7 * i) % 250 + 1 for i in range(32)]  # two full 16-token blocks: the prefix the warm-up request caches
TARGET = SHARED + [(13 * i) % 240 + 5 for i in range(40)]  # past the prefix, three chunks at a 16-token budget
SEEDED = SHARED + [5, 6, 7, 8, 9, 10, 11]
WARM_UP = SHARED + [11, 12]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True, logprobs=3)
TARGETS = [(TARGET, GREEDY), (SEEDED, SAMPLED)]
# Steps of at most 16 tokens (chunked prefill) on a pool of 24 blocks of 16 tokens, too small for 34 requests at once.
CROWDED = dict(max_num_batched_tokens=16, num_blocks=24, max_num_seqs=64, policy="priority")
DTYPES = ["float32"] + (["bfloat16"] if packs(torch.bfloat16) else [])


def others(count: int = 32, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed prompt and output lengths, greedy and seeded sampling, no prefix shared with the targets."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randint(2, 40))] for _ in range(count)]
    params = [SamplingParams(temperature=rng.choice([0, 0.7]), seed=i, max_tokens=rng.randint(4, 48),
                             ignore_eos=True, logprobs=1) for i in range(count)]  # fmt: skip
    return prompts, params


def result(output) -> tuple[list[int], list[dict[int, float]]]:
    completion = output.outputs[0]
    return completion.token_ids, completion.logprobs


def invariant_llm(dtype: str, **options) -> LLM:
    return LLM(TINY_MODEL, device="cpu", dtype=dtype, batch_invariant=True, **options)


@cache
def alone_results(dtype: str) -> list[tuple]:
    """Each target run alone on a fresh engine: its tokens and logprobs."""
    llm = invariant_llm(dtype)
    return [result(llm.generate([prompt], params)[0]) for prompt, params in TARGETS]


@pytest.fixture(params=DTYPES)
def alone(request):
    return request.param, alone_results(request.param)


def watch_target(llm: LLM) -> list[tuple[int, int]]:
    """(tokens allocated, tokens found cached) each time TARGET is admitted: a later admission with more tokens
    than its prompt is its re-prefill after a recompute preemption."""
    manager, seen = llm.engine.block_manager, []
    allocate = manager.allocate

    def watched(seq_id, token_ids, *args, **kwargs):
        cached = allocate(seq_id, token_ids, *args, **kwargs)
        if list(token_ids[: len(TARGET)]) == TARGET:
            seen.append((len(token_ids), cached))
        return cached

    manager.allocate = watched
    return seen


def run_crowd(llm: LLM) -> list:
    """The targets start first, on the prefix the warm-up cached, and decode a little; then a long prompt and 32
    others arrive with a better priority, so on the small pool the targets are the ones preempted, and they
    re-prefill their prompt and output so far in 16-token chunks."""
    engine, finished = llm.engine, {}

    def step() -> None:
        finished.update((out.request_id, out) for out in engine.step() if out.finished)

    llm.generate([WARM_UP], SamplingParams(max_tokens=1))
    for index, (prompt, params) in enumerate(TARGETS):
        engine.add_request(f"target-{index}", prompt, params, priority=1)
    # the targets decode a few tokens first: a better-ranked newcomer now preempts whatever it outranks, and the
    # preemption to check is the one that makes a target re-prefill its prompt plus its output so far
    while len(engine.scheduler.running) < len(TARGETS) or any(
        seq.num_output_tokens < 2 for seq in engine.scheduler.running
    ):
        step()
    # a long better-ranked prompt first: it fits only once the targets give up their blocks, so they are preempted
    engine.add_request("crowder", [(11 * i) % 240 + 3 for i in range(16 * 17)], SamplingParams(max_tokens=4))
    for index, (prompt, params) in enumerate(zip(*others(), strict=True)):
        engine.add_request(f"other-{index}", prompt, params)
    while engine.has_unfinished_requests():
        step()
    return [finished[f"target-{index}"] for index in range(len(TARGETS))]


def test_a_request_is_bitwise_the_same_alone_and_in_a_crowded_chunked_preempting_batch(alone):
    dtype, expected = alone
    llm = invariant_llm(dtype, **CROWDED)
    seen = watch_target(llm)
    assert [result(output) for output in run_crowd(llm)] == expected
    assert seen[0][1] > 0, f"the target did not start on the cached prefix: {seen}"
    assert any(length > len(TARGET) for length, _ in seen), f"the target was never preempted: {seen}"


@pytest.mark.parametrize("max_num_seqs", [1, 5])
def test_a_request_is_the_same_at_any_max_num_seqs_and_step_budget(alone, max_num_seqs):
    dtype, expected = alone
    llm = invariant_llm(dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=7)
    prompts, params = others(8, seed=1)
    outputs = llm.generate([TARGET, *prompts, SEEDED], [GREEDY, *params, SAMPLED])
    assert [result(outputs[0]), result(outputs[-1])] == expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_beams_are_bitwise_the_same_alone_and_in_a_crowded_preempting_batch(dtype):
    """Beam search reads every beam's log-probabilities: in this mode they do not depend on the batch, so neither do
    the beams, alone or among 32 others on a pool too small for all of them (chunked, preempted)."""
    params = SamplingParams(n=3, use_beam_search=True, max_tokens=12, ignore_eos=True, logprobs=2)

    def beams(output):
        return [(c.token_ids, c.cumulative_logprob, c.logprobs) for c in output.outputs]

    alone = beams(invariant_llm(dtype).generate([TARGET], params)[0])
    llm = invariant_llm(dtype, **CROWDED)
    prompts, crowd_params = others()
    outputs = llm.generate([*prompts[:16], TARGET, *prompts[16:]], [*crowd_params[:16], params, *crowd_params[16:]])
    assert beams(outputs[16]) == alone
    assert llm.engine.scheduler.num_preemptions > 0


def test_rescoring_the_output_with_prompt_logprobs_gives_the_sampled_logprobs(alone):
    dtype, expected = alone
    llm = invariant_llm(dtype, max_num_batched_tokens=16)
    for (prompt, _), (tokens, logprobs) in zip(TARGETS, expected, strict=True):
        rescore = SamplingParams(max_tokens=1, prompt_logprobs=3)
        [output] = llm.generate([prompt + tokens], rescore)
        assert output.prompt_logprobs[len(prompt) :] == logprobs


# ---------------------------------------------------------------------------------------------------- serve

server = server_fixture("--batch-invariant", "--dtype", "float32", "--max-num-batched-tokens", "16",
                        "--num-blocks", "24", "--max-num-seqs", "64", "--policy", "priority")  # fmt: skip


def completion_body(prompt: list[int], params: SamplingParams, **extra) -> dict:
    return dict(model=TINY_MODEL, prompt=prompt, max_tokens=params.max_tokens, temperature=params.temperature,
                logprobs=params.logprobs, seed=params.seed,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra})  # fmt: skip


def logprobs_of(choices) -> tuple[list[str], list[float], list[dict]]:
    """tokens, token_logprobs and top_logprobs of one choice, or of a stream's choices concatenated."""
    tokens, values, tops = [], [], []
    for choice in choices:
        if choice.logprobs is None:  # a stream's closing chunk
            continue
        tokens += choice.logprobs.tokens
        values += choice.logprobs.token_logprobs
        tops += choice.logprobs.top_logprobs
    return tokens, values, tops


async def crowded_targets(server) -> list[tuple]:
    """The targets stream first (each past its first token), then 32 others with a better priority arrive."""
    async with server.async_client() as client:
        streams = [await client.completions.create(stream=True, **completion_body(prompt, params, priority=1))
                   for prompt, params in TARGETS]  # fmt: skip
        firsts = [await anext(stream) for stream in streams]
        crowd = [asyncio.create_task(client.completions.create(**completion_body(prompt, params)))
                 for prompt, params in zip(*others(), strict=True)]  # fmt: skip

        async def rest(stream, first):
            return logprobs_of([first.choices[0]] + [chunk.choices[0] async for chunk in stream if chunk.choices])

        results = [await rest(stream, first) for stream, first in zip(streams, firsts, strict=True)]
        await asyncio.gather(*crowd)
        return results


def test_serve_gives_the_alone_result_inside_a_crowd_and_on_rescoring(server):
    client = server.client()
    served = [logprobs_of(client.completions.create(**completion_body(prompt, params)).choices)
                     for prompt, params in TARGETS]  # fmt: skip
    # the same bits as the in-process engine: one mode, one answer, whichever face asks
    assert [values for _, values, _ in served] == [[next(iter(d.values())) for d in logprobs]
                                                          for _, logprobs in alone_results("float32")]  # fmt: skip
    client.completions.create(**completion_body(WARM_UP, SamplingParams(max_tokens=1)))
    assert asyncio.run(crowded_targets(server)) == served
    metrics = server.metrics()
    assert metrics["paged_backend:num_preemptions_total"] > 0 and metrics["paged_backend:prefix_cache_hits_total"] > 0
    for (prompt, _), (tokens, values, tops) in zip(TARGETS, served, strict=True):
        ids = [int(token.removeprefix("token_id:")) for token in tokens]
        body = completion_body(prompt + ids, GREEDY) | dict(max_tokens=0, echo=True)
        rescored = logprobs_of(client.completions.create(**body).choices)
        assert rescored[1][len(prompt) :] == values and rescored[2][len(prompt) :] == tops


# ---------------------------------------------------------------------------------------------------- the parts


def rows_alone_and_batched(forward, x: torch.Tensor, sizes=(2, 3, 7, 8, 9, 17, 33)) -> None:
    """Every row of `forward(x[:m])` equals `forward` of that row alone, for every batch size m."""
    alone = torch.cat([forward(x[i : i + 1]) for i in range(x.shape[0])])
    for m in sizes:
        assert torch.equal(forward(x[:m]), alone[:m]), m
        shifted = torch.cat([torch.randn_like(x[:5]), x[:m]])  # the same rows at other positions in their tiles
        assert torch.equal(forward(shifted)[5:], alone[:m]), m


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_rows_do_not_depend_on_the_batch_or_their_place_in_a_tile(pack, dtype):
    if pack and not packs(dtype):
        pytest.skip(f"{dtype} layers do not pack on this CPU (no panel kernel, and oneDNN does not pack it)")
    torch.manual_seed(0)
    # K=1536: oneDNN's prepacked fp32 kernel sums a row differently at different row counts here
    model = nn.Sequential(nn.Linear(1536, 576), nn.SiLU(), nn.Linear(576, 1536, bias=False)).to(dtype)
    linears = BatchInvariantLinears(model, pack=pack)
    assert len(linears) == 2 and (linears.packed is not None) == pack
    with linears.active(), torch.inference_mode():
        rows_alone_and_batched(model, torch.randn(40, 1536).to(dtype))
        assert ops.batch_invariant_enabled()
    assert not ops.batch_invariant_enabled() and all("forward" not in m.__dict__ for m in model)


def test_activation_rows_take_the_vector_path_wherever_they_sit():
    # width 37: torch computes the last elements of a tensor in scalar code, whose fp32 silu rounds differently
    torch.manual_seed(0)
    rows_alone_and_batched(tiled_elementwise(nn.functional.silu), torch.randn(40, 37) * 4)


def test_layers_that_cannot_be_tiled_are_refused_at_load():
    model = nn.Sequential(nn.Linear(8, 8))
    model[0].register_forward_hook(lambda *args: None)
    with pytest.raises(InvalidRequest, match="hooks"):
        BatchInvariantLinears(model)


def pool(num_blocks=40, block_size=16, kv_heads=2, head_dim=64, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(2)]


ATTENTION_CASES = [
    pytest.param("cpu", 4, torch.float32, None, None, 70, id="g4"),
    pytest.param("cpu", 8, torch.float32, None, None, 70, id="g8"),
    pytest.param("cpu", 8, (torch.float16, FP8), None, None, 70, id="g8-fp8-panel"),  # fp8 caches: panels from 32 rows
    pytest.param("cpu", 4, torch.bfloat16, 20, None, 70, id="bf16-window"),
    pytest.param("cpu", 1, torch.float32, None, 5.0, 70, id="g1-softcap"),
    # contexts the kernel cuts into parts of 2048 keys, merged after; a window that starts inside a part
    pytest.param("cpu", 4, torch.float32, None, None, 2200, id="g4-split"),
    pytest.param("cpu", 4, torch.bfloat16, 600, None, 2200, id="bf16-window-split"),
    # Triton's one-token programs: interpreted here, compiled on a GPU
    pytest.param("triton", 4, torch.float32, None, None, 70, id="triton-g4"),
    pytest.param("triton", 4, torch.bfloat16, 20, None, 70, id="triton-bf16-window"),
    pytest.param("triton", 1, torch.float32, None, 5.0, 70, id="triton-g1-softcap"),
]


@pytest.mark.parametrize(("backend", "group", "dtype", "window", "softcap", "length"), ATTENTION_CASES)
def test_attention_rows_are_the_same_in_prefill_chunks_decode_and_batches(
    backend, group, dtype, window, softcap, length
):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    kernel = ops.triton.paged_attention if backend == "triton" else cpu.paged_attention
    blocks = -(-length // 16)
    dtype, kv_dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)  # the query's, the cache's
    keys, values = (pool_part.to(device) for pool_part in pool(num_blocks=blocks + 8, dtype=kv_dtype))
    table = (torch.randperm(blocks + 7, generator=torch.Generator().manual_seed(1))[:blocks] + 1).to(torch.int32)[None]
    table = table.to(device)
    query = torch.randn(length, 2 * group, 64).to(dtype).to(device)
    options = dict(sliding_window=window, softcap=softcap, invariant=True)

    def attend(first: int, end: int) -> torch.Tensor:  # rows [first, end) of the sequence, its context [0, end)
        lens, starts = torch.tensor([end], dtype=torch.int32), torch.tensor([0, end - first], dtype=torch.int32)
        return kernel(query[first:end], keys, values, table, lens.to(device), starts.to(device), 0.125, **options)

    full = attend(0, length)
    chunks = torch.cat([attend(first, min(first + 13, length)) for first in range(0, length, 13)])
    decodes = torch.cat([attend(position, position + 1) for position in range(length)])
    assert torch.equal(chunks, full) and torch.equal(decodes, full)
    # inside a batch: another sequence's prefill first, then this one's last 9 rows
    other = torch.randn(30, 2 * group, 64).to(dtype).to(device)
    batch_query = torch.cat([other, query[length - 9 :]])
    tables = torch.zeros(2, blocks, dtype=torch.int32, device=device)
    tables[0, :2], tables[1] = torch.tensor([5, 6]), table[0]
    lens, starts = torch.tensor([30, length], dtype=torch.int32), torch.tensor([0, 30, 39], dtype=torch.int32)
    batched = kernel(batch_query, keys, values, tables, lens.to(device), starts.to(device), 0.125, **options)
    assert torch.equal(batched[30:], full[length - 9 :])


def test_triton_keeps_one_kv_segment_for_a_lone_decode_where_its_default_splits():
    # a lone long decode leaves GPU programs idle, so by default Triton splits its KV in segments and merges them:
    # other bits than the same row in a prefill chunk or a full batch, which the invariant mode must not give
    device = "cuda" if torch.cuda.is_available() else "cpu"
    length = 1100  # past 1024 keys: two segments
    blocks = -(-length // 16)
    keys, values = (part.to(device) for part in pool(num_blocks=blocks + 1))
    table = torch.arange(1, blocks + 1, dtype=torch.int32, device=device)[None]
    query = torch.randn(8, 8, 64, device=device)  # the last 8 rows of the sequence
    lens = torch.tensor([length], dtype=torch.int32, device=device)

    def attend(rows: torch.Tensor, invariant: bool) -> torch.Tensor:
        starts = torch.tensor([0, rows.shape[0]], dtype=torch.int32, device=device)
        return ops.triton.paged_attention(rows, keys, values, table, lens, starts, 0.125, invariant=invariant)

    chunk = attend(query, True)
    assert torch.equal(attend(query[-1:], True), chunk[-1:])
    assert not torch.equal(attend(query[-1:], False), chunk[-1:])  # what the mode changes


def test_only_the_cpu_and_triton_backends_run_invariant_attention():
    keys, values = pool(num_blocks=4)
    args = (torch.randn(3, 2, 64), keys, values, torch.tensor([[1]], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 0.125)  # fmt: skip
    with pytest.raises(BackendUnavailable, match="cpu or triton backend"):
        ops.paged_attention(*args, invariant=True, backend="torch")
    with ops.batch_invariant():
        assert torch.equal(ops.paged_attention(*args), ops.paged_attention(*args, invariant=True, backend="cpu"))


def test_a_plain_rows_probabilities_do_not_depend_on_a_masked_neighbour():
    logits = torch.randn(2, 256) * 3
    plain, masked = SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.9, top_k=20)
    alone = Sampler._probabilities(logits[:1], [plain])
    assert torch.equal(Sampler._probabilities(logits, [plain, masked])[:1], alone)
    assert torch.equal(
        Sampler._probabilities(logits[1:], [masked]), Sampler._probabilities(logits, [plain, masked])[1:]
    )


# ---------------------------------------------------------------------------------------------------- the default


def test_the_default_mode_keeps_its_fast_paths(monkeypatch):
    monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)
    assert EngineConfig().batch_invariant is False
    llm = LLM(TINY_MODEL, device="cpu", num_blocks=16)
    assert isinstance(llm.engine.runner.packed, PackedLinears) and not ops.batch_invariant_enabled()
    invariant = LLM(TINY_MODEL, device="cpu", num_blocks=16, batch_invariant=True)
    assert isinstance(invariant.engine.runner.packed, BatchInvariantLinears)
    # the kernel's default tiles (shared K/V loads; the panel score path, which fp8 caches take from 32 rows per kv
    # head) are still what a plain call runs
    keys, values = pool(dtype=FP8)
    args = (torch.randn(70, 8, 64).half(), keys, values, torch.tensor([[3, 17, 9, 30, 1]], dtype=torch.int32),
            torch.tensor([70], dtype=torch.int32), torch.tensor([0, 70], dtype=torch.int32), 0.125)  # fmt: skip
    assert torch.equal(cpu.paged_attention(*args), cpu.paged_attention(*args, invariant=False))
    assert not torch.equal(cpu.paged_attention(*args), cpu.paged_attention(*args, invariant=True))


def test_the_environment_switches_it_on_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    assert EngineConfig().batch_invariant is True
    assert EngineArgs(batch_invariant=False).to_engine_config().batch_invariant is False
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "0")
    assert EngineArgs().to_engine_config().batch_invariant is False


@pytest.mark.parametrize("options", [dict(attention_backend="torch"), dict(enable_lora=True)], ids=str)
def test_what_the_mode_does_not_cover_is_refused(options):
    with pytest.raises(InvalidRequest, match="batch-invariant"):
        LLM(TINY_MODEL, device="cpu", num_blocks=16, batch_invariant=True, **options)
