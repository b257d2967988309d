"""LoRA on the TGI face: `--lora-adapters id=path,...` and each request's `adapter_id` (sent by
huggingface_hub's InferenceClient; the text-generation 0.7 client has no adapter_id field). For a tiny Llama and
a tiny Qwen2, and the Llama on two tensor-parallel shards (`--num-shard 2`), concurrent requests of three adapters
and the base model equal peft's greedy tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from _lora_helpers import DTYPE, reference_tokens, save_base_and_adapters
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError

from tests._tgi_helpers import TgiServer, running

MAX_NEW_TOKENS = 8
TEXTS = ["Hello world, adapters!", "abc"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-2-shards"])
def setup(request, tmp_path_factory):
    arch, _, shards = request.param.partition("-")
    model_dir, adapters = save_base_and_adapters(arch, tmp_path_factory.mktemp(f"lora-tgi-{arch}"))
    flag = ",".join(f"{name}={path}" for name, path in adapters.items())
    sharded = ["--num-shard", "2", "--device", "cpu"] if shards else []
    server = TgiServer("paged", ["--model-id", str(model_dir), "--dtype", DTYPE, "--lora-adapters", flag, *sharded])
    with running(server):
        ranks = psutil.Process(server.process.pid).children(recursive=True)
        assert bool(shards) == any("python" in rank.name() for rank in ranks)  # the second shard is its own process
        yield arch, server, adapters


def test_adapter_id_selects_the_adapter_in_a_mixed_batch(setup):
    arch, server, adapters = setup
    client = InferenceClient(server.url, timeout=120)
    jobs = [(adapter_id, text) for adapter_id in [None, *adapters] for text in TEXTS]

    def generate(job):
        adapter_id, text = job
        return client.text_generation(text, max_new_tokens=MAX_NEW_TOKENS, details=True, decoder_input_details=True,
                                      adapter_id=adapter_id)  # fmt: skip

    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(generate, jobs))
    for (adapter_id, _), response in zip(jobs, responses, strict=True):
        prompt = [token.id for token in response.details.prefill]
        [expected] = reference_tokens(arch, adapters.get(adapter_id), [prompt], MAX_NEW_TOKENS)
        assert [token.id for token in response.details.tokens] == expected, adapter_id
    with pytest.raises(ValidationError, match="attn4"):  # a 422 naming the loaded adapters
        client.text_generation("hi", max_new_tokens=2, adapter_id="nope")
    server.wait_until_drained()
