"""Structured outputs: what a JSON-schema constraint costs the engine, and which grammar backend to use.

`engine` (default): the engine with the embedded model on CPU, output tok/s at batch 1, 16 and 64 with a JSON-schema
constraint against unconstrained, in one run. Each constrained run goes first; the unconstrained run then asks for
exactly the token counts the constrained requests produced (EOS ignored), so both runs do the same steps and only
the masks differ. The random model fills every JSON gap with whitespace, so documents run to ~300 byte tokens. Both sample at temperature 1 with per-request seeds. Also prints grammar compile times.

`backends`: xgrammar vs llguidance, the measurement behind the choice of llguidance. A ~32k-token byte-level BPE
tokenizer is trained locally (no hub) on generated JSON-ish text, plus the embedded 256-token byte tokenizer. For
each backend: compile a dozen schemas (cold, one fresh compiler each), then drive 64 matchers through valid
documents token by token and time the batched bitmask fill (and the apply into [64, V] logits) per step.

    python benchmarks/structured.py --device cpu                # engine table, ~2 minutes on 2 busy cores
    python benchmarks/structured.py --part backends             # backend table, ~1-2 minutes
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from transformers import PreTrainedTokenizerFast

from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import byte_tokenizer

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]},
    {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 100}, "maxItems": 8},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}}}, "required": ["id", "email"]}},
     "required": ["user"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                         "required": ["x", "y"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
     "required": ["a", "b"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                      "count": {"type": "integer", "minimum": 1, "maximum": 999}},
     "required": ["id", "count"]},
    {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "integer"}, {"type": "null"}]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"]}, "minItems": 1, "maxItems": 5}, "total": {"type": "number"}},
     "required": ["items", "total"]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                                      "time": {"type": "string", "format": "time"}}, "required": ["date"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                      "rating": {"type": "number", "minimum": 0, "maximum": 5},
                                      "review": {"type": "string"}, "recommend": {"type": "boolean"}},
     "required": ["title", "rating", "recommend"], "additionalProperties": False},
    {"type": "object", "properties": {"tree": {"$ref": "#/$defs/node"}}, "required": ["tree"],
     "$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                         "children": {"type": "array",
                                                                      "items": {"$ref": "#/$defs/node"}}},
                        "required": ["value"]}}},
    {"type": "object", "properties": {"kind": {"const": "event"}, "payload": {"type": "object"},
                                      "level": {"type": "string", "enum": ["debug", "info", "warn", "error"]}},
     "required": ["kind", "level"]},
]

# One valid document per schema, to walk the matchers through realistic states.
DOCUMENTS: list[object] = [
    {"name": "Ada Lovelace", "age": 36},
    [1.5, 22, 99.75, 0, 42],
    {"color": "green", "ok": True},
    {"user": {"id": 1234, "email": "ada@example.com", "tags": ["math", "poetry"]}},
    {"a": {"x": 1.25, "y": -3}, "b": {"x": 0, "y": 7.5}},
    {"id": "ABC-1234", "count": 17},
    "hello structured",
    {"items": [{"sku": "A-1", "qty": 2, "price": 9.99}, {"sku": "B-22", "qty": 1, "price": 120}], "total": 139.98},
    {"date": "2024-05-17", "time": "12:30:00Z"},
    {"title": "Great engine", "rating": 4.5, "review": "Fast and correct paging.", "recommend": True},
    {"tree": {"value": 1, "children": [{"value": 2}, {"value": 3, "children": [{"value": 4}]}]}},
    {"kind": "event", "payload": {"source": "scheduler", "blocks": 128}, "level": "info"},
]


def train_bpe_tokenizer(vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on generated words, numbers and JSON, so its merges look like a real one's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in ["a", "e", "i", "o", "u", "ou", "ea", "ai"]]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(40000)]

    def line() -> str:
        pick = rng.random()
        if pick < 0.5:
            return " ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) + "."
        if pick < 0.8:
            doc = {rng.choice(words): rng.choice([rng.randint(-999, 99999), round(rng.uniform(-1e3, 1e3), 3),
                                                  rng.choice(words), True, None]) for _ in range(rng.randint(1, 6))}
            return json.dumps(doc, indent=rng.choice([None, 2]))
        return " ".join(str(rng.randint(0, 10**rng.randint(1, 8))) for _ in range(8))

    corpus = [line() for _ in range(60000)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=[tokenizer.eos_token_id])
        self.threads = threads
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def fill(self, matchers, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, threads: int) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        # The grammar is built inside the matcher: the first one is the compile, later ones copy it (as the product).
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def fill(self, matchers, bitmask: torch.Tensor) -> None:
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)


def measure(backend, tokenizer, vocab_size: int, batch_size: int, steps: int) -> dict:
    import xgrammar as xgr  # its CPU apply kernel serves both backends, so only the fill differs

    compile_ms = []
    compiled = []
    for schema in SCHEMAS:
        start = time.perf_counter()
        compiled.append(backend.compile(schema))
        compile_ms.append((time.perf_counter() - start) * 1e3)
    start = time.perf_counter()
    for grammar in compiled:
        backend.matcher(grammar)
    new_matcher_us = (time.perf_counter() - start) / len(compiled) * 1e6

    docs = [tokenizer(json.dumps(doc), add_special_tokens=False).input_ids for doc in DOCUMENTS]
    rows = [i % len(SCHEMAS) for i in range(batch_size)]
    matchers = [backend.matcher(compiled[r]) for r in rows]
    # Rows start at staggered positions and restart their document when done: a steady mix of grammar states.
    positions = [(i // len(SCHEMAS) * 3) % len(docs[r]) for i, r in enumerate(rows)]
    for matcher, r, position in zip(matchers, rows, positions, strict=True):
        assert all(backend.accept(matcher, token) for token in docs[r][:position])
    bitmask = torch.full(((batch_size), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(batch_size, vocab_size)
    fill_ms, apply_ms = [], []
    for _ in range(steps):
        start = time.perf_counter()
        backend.fill(matchers, bitmask)
        mid = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        end = time.perf_counter()
        fill_ms.append((mid - start) * 1e3)
        apply_ms.append((end - mid) * 1e3)
        for i, r in enumerate(rows):
            token = docs[r][positions[i]]
            assert bitmask[i, token // 32] >> (token % 32) & 1, (backend.name, r, positions[i])
            assert backend.accept(matchers[i], token), (backend.name, r, positions[i])
            positions[i] += 1
            if positions[i] == len(docs[r]):
                matchers[i], positions[i] = backend.matcher(compiled[r]), 0
    return dict(compile_ms=compile_ms, new_matcher_us=new_matcher_us, fill_ms=fill_ms, apply_ms=apply_ms)


# The engine benchmark's constraint: an order with bounded strings and arrays.
ENGINE_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["order_id", "customer", "items", "status"],
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"},
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "tier"],
                     "properties": {"name": {"type": "string", "maxLength": 16},
                                    "tier": {"enum": ["free", "pro", "enterprise"]}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
            "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1,
                                                                               "maximum": 99},
                           "price": {"type": "number", "minimum": 0, "maximum": 10000, "multipleOf": 0.01}}}},
        "status": {"enum": ["new", "paid", "shipped"]},
        "gift": {"type": "boolean"},
    },
}


def compile_times(tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
    """Cold manager construction, cold compiles of the dozen schemas plus the engine's, and a cached lookup."""
    from paged_backend.structured import StructuredOutputsParams
    from paged_backend.structured.manager import StructuredOutputManager

    start = time.perf_counter()
    manager = StructuredOutputManager(tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
    built_ms = (time.perf_counter() - start) * 1e3
    cold = []
    for schema in [*SCHEMAS, ENGINE_SCHEMA]:
        start = time.perf_counter()
        manager.validate(StructuredOutputsParams(json=schema))
        cold.append((time.perf_counter() - start) * 1e3)
    start = time.perf_counter()
    for _ in range(100):
        manager.new_matcher(StructuredOutputsParams(json=ENGINE_SCHEMA))
    cached_us = (time.perf_counter() - start) / 100 * 1e6
    print(f"grammar compile ({len(cold)} JSON schemas, cold): total {sum(cold):.1f} ms, median "
          f"{statistics.median(cold):.2f} ms, max {max(cold):.2f} ms; manager construction {built_ms:.1f} ms; "
          f"cached validate + new_matcher {cached_us:.0f} us")


def engine_throughput(args: argparse.Namespace) -> None:
    from paged_backend.engine import LLM, SamplingParams
    from paged_backend.structured import StructuredOutputsParams

    torch.set_num_threads(args.torch_threads)
    llm = LLM(TINY_MODEL, device=args.device, num_blocks=args.num_blocks)
    engine = llm.engine
    compile_times(engine.tokenizer, engine.vocab_size, set(engine.eos_token_ids))
    constraint = StructuredOutputsParams(json=ENGINE_SCHEMA)
    llm.generate(["warm-up"] * 4, SamplingParams(structured_outputs=constraint, temperature=1.0, seed=0,
                                                 max_tokens=512))
    manager = engine.sampler.structured
    mask_seconds = []
    apply_masks = manager.apply_masks

    def timed_apply_masks(logits, matchers):  # the benchmark's only instrumentation: mask fill + apply time
        start = time.perf_counter()
        apply_masks(logits, matchers)
        mask_seconds.append(time.perf_counter() - start)

    manager.apply_masks = timed_apply_masks

    def timed(prompts, params) -> tuple[float, list[int]]:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        return time.perf_counter() - start, [len(o.outputs[0].token_ids) for o in outputs]

    print(f"\nembedded model on {args.device}, {args.torch_threads} torch thread(s), best of {args.repeats} runs each "
          "(the box is shared; the best run is the least disturbed one)")
    print("| batch | output tokens | unconstrained tok/s | JSON schema tok/s | constrained / unconstrained | "
          "mask ms/step |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 16, 64):
        prompts = [f"Order {i}, as JSON: " for i in range(batch)]
        constrained = [SamplingParams(structured_outputs=constraint, temperature=1.0, seed=100 + i,
                                      max_tokens=1024) for i in range(batch)]
        runs = []
        mask_seconds.clear()
        for _ in range(args.repeats):
            seconds, lengths = timed(prompts, constrained)
            free = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=n, ignore_eos=True)
                    for i, n in enumerate(lengths)]
            free_seconds, free_lengths = timed(prompts, free)
            assert free_lengths == lengths
            runs.append((sum(lengths) / free_seconds, sum(lengths) / seconds))
        unconstrained = max(run[0] for run in runs)
        structured = max(run[1] for run in runs)
        mask_ms = statistics.median(mask_seconds) * 1e3
        print(f"| {batch} | {sum(lengths)} | {unconstrained:.0f} | {structured:.0f} | {structured / unconstrained:.3f} "
              f"| {mask_ms:.3f} |")


def backend_comparison(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    bpe = train_bpe_tokenizer(args.vocab_size)
    print(f"trained a {len(bpe)}-token BPE tokenizer in {time.perf_counter() - start:.1f} s")
    tokenizers = [("byte-256", byte_tokenizer()), (f"bpe-{len(bpe)}", bpe)]
    print("| tokenizer | backend | compile total (ms) | compile median / max (ms) | new matcher (us) | "
          f"fill @{args.batch_size} p50 / p99 (ms) | apply p50 (ms) |")
    print("|---|---|---|---|---|---|---|")
    for label, tokenizer in tokenizers:
        vocab_size = len(tokenizer)
        for backend_class in (XGrammarBackend, LLGuidanceBackend):
            backend = backend_class(tokenizer, vocab_size, args.fill_threads)
            result = measure(backend, tokenizer, vocab_size, args.batch_size, args.steps)
            fill = sorted(result["fill_ms"])
            print(f"| {label} | {backend.name} | {sum(result['compile_ms']):.1f} | "
                  f"{statistics.median(result['compile_ms']):.1f} / {max(result['compile_ms']):.1f} | "
                  f"{result['new_matcher_us']:.0f} | {statistics.median(fill):.3f} / "
                  f"{fill[int(0.99 * (len(fill) - 1))]:.3f} | {statistics.median(result['apply_ms']):.3f} |")
    start = time.perf_counter()
    compile_times(bpe, len(bpe), {bpe.eos_token_id})
    print(f"(the product's manager on the {len(bpe)}-token tokenizer, {time.perf_counter() - start:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["engine", "backends"], default="engine")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--torch-threads", type=int, default=1, help="engine torch threads (1 is stable when shared)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab-size", type=int, default=32000, help="backends: the trained BPE tokenizer's size")
    parser.add_argument("--batch-size", type=int, default=64, help="backends: matchers per mask step")
    parser.add_argument("--steps", type=int, default=200, help="backends: mask steps timed")
    parser.add_argument("--fill-threads", type=int, default=2, help="backends: mask-fill threads per backend")
    args = parser.parse_args()
    if args.part == "engine":
        engine_throughput(args)
    else:
        backend_comparison(args)


if __name__ == "__main__":
    main()
