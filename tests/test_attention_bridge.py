"""The "paged_backend" attention implementation inside a real HF model: packed varlen forwards."""

import pytest
import torch
from transformers import Cache, LlamaConfig, LlamaForCausalLM

from paged_backend import BlockManager, PagedKVCache, UnsupportedModel
from paged_backend.worker.attention import PackedKV, PagedMetadata, register_paged_attention


class StepCache(Cache):
    """Minimal owner of one packed forward: writes through PackedKV handles."""

    def __init__(self, kv: PagedKVCache, metadata: PagedMetadata):
        super().__init__(layers=[])
        self.kv, self.metadata = kv, metadata

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        handle = PackedKV(self.kv, layer_idx, key_states, value_states, self.metadata)
        return handle, handle


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = register_paged_attention()
    return LlamaForCausalLM(config).eval()


def metadata_for(bm, seqs, new_tokens):
    """Packed metadata: seqs[i] gets new_tokens[i] tokens appended after its current ones."""
    slots, lens, starts = [], [], [0]
    for seq_id, n in zip(seqs, new_tokens, strict=True):
        total = bm.num_tokens(seq_id)
        slots += bm.slot_mapping(seq_id, total - n, total)
        lens.append(total)
        starts.append(starts[-1] + n)
    width = max(len(bm.block_table(s)) for s in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(bm.block_table(s))] = torch.tensor(bm.block_table(s))
    as32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return PagedMetadata(torch.tensor(slots), tables, as32(lens), as32(starts))


@torch.no_grad()
def test_packed_prefill_and_decode_match_contiguous_forward():
    model = tiny_llama()
    cfg = model.config
    kv = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 32, 4, dtype=torch.float32)
    bm = BlockManager(32, 4)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    for i, p in enumerate(prompts):
        bm.allocate(i, p)
    ids = torch.tensor([sum(prompts, [])])
    pos = torch.tensor([sum([list(range(len(p))) for p in prompts], [])])
    meta = metadata_for(bm, [0, 1], [len(p) for p in prompts])
    logits = model(input_ids=ids, position_ids=pos, past_key_values=StepCache(kv, meta)).logits[0]

    model.config._attn_implementation = "sdpa"
    ref = [model(input_ids=torch.tensor([p])).logits[0] for p in prompts]
    torch.testing.assert_close(logits[:7], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[7:], ref[1], atol=1e-5, rtol=1e-5)

    # One decode step for both sequences, packed.
    model.config._attn_implementation = "paged_backend"
    nxt = [int(ref[0][-1].argmax()), int(ref[1][-1].argmax())]
    for i, t in enumerate(nxt):
        bm.append_slots(i, [t])
    meta = metadata_for(bm, [0, 1], [1, 1])
    step = model(input_ids=torch.tensor([nxt]), position_ids=torch.tensor([[7, 3]]),
                 past_key_values=StepCache(kv, meta)).logits[0]
    model.config._attn_implementation = "sdpa"
    for i, p in enumerate(prompts):
        full = model(input_ids=torch.tensor([p + [nxt[i]]])).logits[0, -1]
        torch.testing.assert_close(step[i], full, atol=1e-5, rtol=1e-5)


def test_paged_attention_without_paged_cache_says_what_to_do():
    model = tiny_llama()
    with pytest.raises(UnsupportedModel, match="PagedCache"):
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
