"""A router emulator replays TGI v3's call sequence against the shard subprocess over a real unix socket."""

from __future__ import annotations

import math
import shutil
import tempfile

import grpc
import pytest

from paged_backend.config import CacheConfig, EngineConfig
from paged_backend.engine import Engine, SamplingParams
from paged_backend.tgi.proto import generate_pb2 as pb
from paged_backend.tgi.proto import generate_pb2_grpc as pb_grpc
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import byte_tokenizer
from tests._tgi_helpers import Shard, running, warmup_request

BLOCK_SIZE = 16
NUM_BLOCKS = 129
U64_MAX = 2**64 - 1
PROMPTS = {1: ("Hello world", 4), 2: ("The quick brown fox", 9), 3: ("paged attention", 7)}


@pytest.fixture(scope="module")
def shard():
    directory = tempfile.mkdtemp(prefix="tgi-", dir="/tmp")  # unix socket paths must stay short
    process = Shard(f"{directory}/shard", ["--num-blocks", str(NUM_BLOCKS), "--device", "cpu"])
    with running(process):
        yield process
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def stub(shard):
    with grpc.insecure_channel(f"unix://{shard.socket_path}") as channel:
        yield pb_grpc.TextGenerationServiceStub(channel)


class BlockAllocator:
    """The router's side of v3: blocks from 1 up (block 0 is the health check's), slots follow the blocks."""

    def __init__(self) -> None:
        self.next_block = 1

    def allocate(self, num_tokens: int) -> tuple[list[int], list[int]]:
        blocks = list(range(self.next_block, self.next_block + math.ceil(num_tokens / BLOCK_SIZE)))
        self.next_block += len(blocks)
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(num_tokens)]
        return blocks, slots


def greedy(max_new_tokens: int) -> dict:
    return dict(
        parameters=pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new_tokens, ignore_eos_token=True),
    )


def text_request(request_id: int, text: str, max_new_tokens: int, blocks: list[int], slots: list[int],
                 **extra) -> pb.Request:
    """A greedy text request on the blocks and slots the router chose for it."""
    return pb.Request(
        id=request_id,
        inputs=text,
        input_chunks=pb.Input(chunks=[pb.InputChunk(text=text)]),
        add_special_tokens=True,
        blocks=blocks,
        slots=slots,
        **greedy(max_new_tokens),
        **extra,
    )


def request(request_id: int, allocator: BlockAllocator, **extra) -> pb.Request:
    text, max_new_tokens = PROMPTS[request_id]
    input_length = len(byte_tokenizer()(text).input_ids)
    blocks, slots = allocator.allocate(input_length + max_new_tokens - 1)
    return text_request(request_id, text, max_new_tokens, blocks, slots, **extra)


def batch(batch_id: int, requests: list[pb.Request]) -> pb.Batch:
    max_tokens = sum(len(r.slots) + 1 for r in requests)
    return pb.Batch(id=batch_id, requests=requests, size=len(requests), max_tokens=max_tokens)


def liveness() -> pb.PrefillRequest:
    probe = pb.Request(
        id=U64_MAX,
        inputs="liveness",
        input_chunks=pb.Input(chunks=[pb.InputChunk(text="liveness")]),
        truncate=1,
        add_special_tokens=False,
        blocks=[0],
        slots=[0],
        **greedy(1),
    )
    return pb.PrefillRequest(batch=pb.Batch(id=U64_MAX, requests=[probe], size=1, max_tokens=2, max_blocks=1))


def engine_tokens(prompts: dict[int, tuple[str, int]] = PROMPTS) -> dict[int, list[int]]:
    """The in-process engine's greedy tokens for each prompt (the shard must match them)."""
    engine = Engine(EngineConfig(model=TINY_MODEL, device="cpu", cache=CacheConfig(num_blocks=64)))
    for request_id, (text, max_new_tokens) in prompts.items():
        params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
        engine.add_request(str(request_id), text, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[int(output.request_id)] = output.outputs[0].token_ids
    return outputs


def test_router_call_sequence_matches_in_process_engine(shard, stub):
    discovery = stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())
    assert list(discovery.urls) == [f"unix://{shard.socket_path}"]
    stub.ClearCache(pb.ClearCacheRequest())
    info = stub.Info(pb.InfoRequest())
    assert (info.requires_padding, info.block_size, info.attention_impl) == (False, BLOCK_SIZE, "paged")
    assert not info.support_chunking and not info.use_prefix_caching and not info.HasField("window_size")
    warm = stub.Warmup(warmup_request(max_input=255, max_total=256))
    assert warm.max_supported_total_tokens == NUM_BLOCKS * BLOCK_SIZE
    assert (warm.max_input_tokens, warm.max_total_tokens) == (255, 256)  # echoed: the router asserts this

    allocator = BlockAllocator()
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}

    def record(generations) -> set[int]:
        finished = set()
        for generation in generations:
            tokens.setdefault(generation.request_id, []).extend(generation.tokens.ids)
            if generation.HasField("generated_text"):
                finished.add(generation.request_id)
                texts[generation.request_id] = generation.generated_text.text
                assert generation.generated_text.generated_tokens == len(tokens[generation.request_id])
                assert generation.generated_text.finish_reason == pb.FINISH_REASON_LENGTH
                assert not generation.generated_text.HasField("seed")  # greedy
        return finished

    first = stub.Prefill(
        pb.PrefillRequest(
            batch=batch(10, [request(1, allocator, prefill_logprobs=True), request(2, allocator, top_n_tokens=2)])
        )
    )
    prefill_tokens = {g.request_id: g.prefill_tokens for g in first.generations}
    assert math.isnan(prefill_tokens[1].logprobs[0]) and len(prefill_tokens[1].ids) == len(
        byte_tokenizer()("Hello world").input_ids
    )
    assert len(prefill_tokens[2].ids) == 0
    assert [len(g.top_tokens) for g in first.generations] == [0, 1]
    record(first.generations)
    second = stub.Prefill(pb.PrefillRequest(batch=batch(11, [request(3, allocator)])))
    record(second.generations)

    batches = [first.batch, second.batch]
    while batches:
        decoded = stub.Decode(pb.DecodeRequest(batches=batches))
        finished = record(decoded.generations)
        cached = decoded.batch
        if not decoded.HasField("batch"):
            break
        assert cached.id == 10  # concatenated batches keep the first id
        if finished:
            keep = [i for i in cached.request_ids if i not in finished]
            if not keep:
                stub.ClearCache(pb.ClearCacheRequest(id=cached.id))
                break
            cached = stub.FilterBatch(pb.FilterBatchRequest(batch_id=cached.id, request_ids=keep)).batch
            assert list(cached.request_ids) == keep
        batches = [cached]

    assert tokens == engine_tokens()
    tokenizer = byte_tokenizer()
    assert texts == {i: tokenizer.decode(ids, skip_special_tokens=True) for i, ids in tokens.items()}

    probe = stub.Prefill(liveness())
    assert not probe.HasField("batch") and probe.generations[0].request_id == U64_MAX
    assert probe.generations[0].generated_text.generated_tokens == 1


def test_liveness_prefill_on_block_0_corrupts_nothing(stub):
    allocator = BlockAllocator()
    before = stub.Prefill(pb.PrefillRequest(batch=batch(20, [request(2, allocator)])))
    stub.Prefill(liveness())
    decoded = stub.Decode(pb.DecodeRequest(batches=[before.batch]))
    stub.ClearCache(pb.ClearCacheRequest(id=20))
    expected = engine_tokens()[2][:2]
    assert [before.generations[0].tokens.ids[0], decoded.generations[0].tokens.ids[0]] == expected


def test_filter_batch_drops_a_disconnected_request(stub):
    allocator = BlockAllocator()
    prefill = stub.Prefill(pb.PrefillRequest(batch=batch(30, [request(2, allocator), request(3, allocator)])))
    kept = stub.FilterBatch(pb.FilterBatchRequest(batch_id=30, request_ids=[3])).batch
    assert list(kept.request_ids) == [3] and kept.size == 1
    decoded = stub.Decode(pb.DecodeRequest(batches=[kept]))
    assert [g.request_id for g in decoded.generations] == [3]
    stub.ClearCache(pb.ClearCacheRequest(id=30))
    assert prefill.batch.size == 2


def test_unknown_batch_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as error:
        stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=999, request_ids=[1], size=1)]))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def _prompt_slots(blocks: list[int], count: int) -> list[int]:
    return [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(count)]


MALFORMED = {
    "block past the pool": ([text_request(50, "Hello world", 4, [NUM_BLOCKS], _prompt_slots([NUM_BLOCKS], 14))],
                            "block 129 is outside the KV pool: blocks are 0..128"),
    "block far past the pool": ([text_request(51, "Hello world", 4, [10**6], _prompt_slots([10**6], 14))],
                                "outside the KV pool"),
    "slots past the blocks": ([text_request(52, "Hello world", 4, [1], _prompt_slots([1, 2], 20))],
                              "20 slots need 2 blocks of 16 tokens; the request has 1"),
    "no requests": ([], "has no requests"),
    "no input tokens": ([pb.Request(id=53, inputs="", input_chunks=pb.Input(chunks=[pb.InputChunk(text="")]),
                                    blocks=[1], slots=[16], **greedy(1))], "request 53 has no input tokens"),
}  # fmt: skip


@pytest.mark.parametrize("requests, said", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_prefills_are_invalid_argument_and_the_shard_lives_on(shard, stub, requests, said):
    """The router's blocks index the pool in the kernels unchecked: a block past it crashed the shard (SIGSEGV)."""
    with pytest.raises(grpc.RpcError) as error:
        stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=50, requests=requests, size=len(requests))))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert said in error.value.details()
    assert shard.process.poll() is None
    stub.Health(pb.HealthRequest())


def test_top_n_tokens_past_the_vocabulary_is_the_whole_vocabulary(stub):
    prefill = stub.Prefill(pb.PrefillRequest(batch=batch(55, [request(1, BlockAllocator(), top_n_tokens=2**31)])))
    stub.ClearCache(pb.ClearCacheRequest(id=55))
    assert len(prefill.generations[0].top_tokens[0].ids) == len(byte_tokenizer())


def test_a_bad_decode_or_filter_leaves_the_cached_batches_as_they_were(stub):
    prefill = stub.Prefill(pb.PrefillRequest(batch=batch(60, [request(2, BlockAllocator())])))
    unknown = pb.CachedBatch(id=999, request_ids=[1], size=1)
    for call, code in ((lambda: stub.Decode(pb.DecodeRequest(batches=[prefill.batch, unknown])), "NOT_FOUND"),
                       (lambda: stub.Decode(pb.DecodeRequest(batches=[prefill.batch, prefill.batch])), "INVALID_ARGUMENT"),
                       (lambda: stub.FilterBatch(pb.FilterBatchRequest(batch_id=60, request_ids=[])), "INVALID_ARGUMENT"),
                       (lambda: stub.FilterBatch(pb.FilterBatchRequest(batch_id=60, request_ids=[7])), "INVALID_ARGUMENT")):
        with pytest.raises(grpc.RpcError) as error:
            call()
        assert error.value.code().name == code, error.value.details()
    decoded = stub.Decode(pb.DecodeRequest(batches=[prefill.batch]))  # still cached, still whole
    stub.ClearCache(pb.ClearCacheRequest(id=60))
    assert [prefill.generations[0].tokens.ids[0], decoded.generations[0].tokens.ids[0]] == engine_tokens()[2][:2]


def test_cache_len_reuses_prefix_blocks_the_router_shares(stub):
    """With prefix caching the router hands a new request the blocks of an earlier one and sets cache_len."""
    text = "a prompt that is long enough to fill two whole blocks"
    length = len(byte_tokenizer()(text).input_ids)
    expected = engine_tokens({1: (text, 5)})[1]

    def prefill_request(request_id, blocks, cache_len, max_new_tokens):
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length + max_new_tokens - 1)]
        return text_request(request_id, text, max_new_tokens, blocks, slots, cache_len=cache_len)

    first = stub.Prefill(pb.PrefillRequest(batch=batch(40, [prefill_request(40, [1, 2, 3, 4], 0, 1)])))
    assert list(first.generations[0].tokens.ids) == expected[:1]
    # First two full blocks shared; then the whole prompt, whose tail block 5 the first pass filled.
    for cache_len in (2 * BLOCK_SIZE, length):
        reused = prefill_request(41, [1, 2, 5, 6], cache_len, 5)
        response = stub.Prefill(pb.PrefillRequest(batch=batch(41, [reused])))
        tokens = list(response.generations[0].tokens.ids)
        cached = response.batch
        while cached.request_ids:
            decoded = stub.Decode(pb.DecodeRequest(batches=[cached]))
            tokens += [g.tokens.ids[0] for g in decoded.generations]
            if not decoded.HasField("batch"):
                break
            cached = decoded.batch
        assert tokens == expected
