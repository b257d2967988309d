"""Hypothesis-generated JSON schemas: whatever a random-weight model writes under one validates with jsonschema.

The strategy only builds schemas whose documents are finite for any sampler: strings have a maxLength, arrays a
maxItems, objects no additional properties, fractional numbers a multipleOf, and nesting stops at depth 2, so every
output must end with "stop" well inside max_tokens.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import torch
from _engine_helpers import reference_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_backend.engine import LLM, SamplingParams
from paged_backend.structured import StructuredOutputsParams
from paged_backend.worker.models import byte_tokenizer

KEYS = st.sampled_from(["a", "id", "name", "value", "tags", "x_y", "Ü"])


@st.composite
def integers(draw) -> dict:
    low = draw(st.integers(-1000, 1000))
    return {"type": "integer", "minimum": low, "maximum": low + draw(st.integers(0, 500))}


@st.composite
def numbers(draw) -> dict:
    low = draw(st.integers(-50, 50))
    return {"type": "number", "minimum": low, "maximum": low + draw(st.integers(0, 50)),
            # Binary fractions only: jsonschema divides floats, so it judges 2.8 no multiple of 0.1.
            "multipleOf": draw(st.sampled_from([0.5, 0.25]))}


@st.composite
def strings(draw) -> dict:
    longest = draw(st.integers(0, 8))
    return {"type": "string", "minLength": draw(st.integers(0, longest)), "maxLength": longest}


LEAVES = st.one_of(
    integers(), numbers(), strings(),
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.lists(st.one_of(st.text(max_size=5), st.integers(-9, 9), st.none()), min_size=1, max_size=4, unique=True)
    .map(lambda values: {"enum": values}),
    st.one_of(st.text(max_size=4), st.booleans()).map(lambda value: {"const": value}),
)


@st.composite
def objects(draw, children) -> dict:
    properties = draw(st.dictionaries(KEYS, children, min_size=1, max_size=3))
    required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True))
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@st.composite
def arrays(draw, children) -> dict:
    most = draw(st.integers(0, 3))
    return {"type": "array", "items": draw(children), "minItems": draw(st.integers(0, most)), "maxItems": most}


def extend(children):
    return st.one_of(objects(children), arrays(children),
                     st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options}))


SCHEMAS = st.recursive(LEAVES, extend, max_leaves=6).filter(lambda schema: len(json.dumps(schema)) < 600)

LLM_FOR_FUZZ: list[LLM] = []


def fuzz_llm() -> LLM:
    """One engine for every example (hypothesis runs many examples inside one test)."""
    if not LLM_FOR_FUZZ:
        LLM_FOR_FUZZ.append(LLM(copy.deepcopy(reference_model("llama")), tokenizer=byte_tokenizer(), num_blocks=512,
                                block_size=4))
    return LLM_FOR_FUZZ[0]


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16), compact=st.booleans())
def test_generated_schemas_always_yield_valid_documents(schema, seed, compact):
    llm = fuzz_llm()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
        params = [SamplingParams(structured_outputs=constraint, temperature=temperature, seed=seed, max_tokens=600)
                  for temperature in (0.0, 1.0)]
        outputs = llm.generate(["Fuzz:", "Fuzz:"], params)
    finally:
        torch.set_num_threads(threads)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks - 1
