"""StructuredOutputManager on its own: masks, accept, termination, the compile cache and the errors users get."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from paged_backend.errors import InvalidRequest
from paged_backend.structured import StructuredOutputsParams
from paged_backend.structured.manager import StructuredOutputManager
from paged_backend.worker.models import SPECIAL_TOKENS, byte_tokenizer

EOS = SPECIAL_TOKENS["<|eos|>"]
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", name="manager")
def manager_fixture() -> StructuredOutputManager:
    # vocab_size 300 > the tokenizer's 256: the model's padded logits columns must be masked too.
    return StructuredOutputManager(byte_tokenizer(), vocab_size=300, eos_token_ids={EOS})


def allowed(manager: StructuredOutputManager, matcher, width: int = 300) -> set[int]:
    logits = torch.zeros(1, width)
    manager.apply_masks(logits, [matcher])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def walk(matcher, text: str) -> bool:
    return all(matcher.accept(byte) for byte in text.encode())


def test_json_schema_start_allows_only_an_object_opening(manager):
    matcher = manager.new_matcher(StructuredOutputsParams(json=POINT))
    assert allowed(manager, matcher) == {ord("{")}  # no whitespace before the root value


def test_valid_document_is_accepted_and_terminates(manager):
    matcher = manager.new_matcher(StructuredOutputsParams(json=POINT))
    assert walk(matcher, '{"x": 1, "y": -20')
    assert not matcher.is_terminated()
    assert ord("}") in allowed(manager, matcher) and EOS not in allowed(manager, matcher)
    assert walk(matcher, "}")
    assert matcher.is_terminated()  # nothing but EOS can follow a closed root object
    assert allowed(manager, matcher) == {EOS}
    assert matcher.accept(EOS)


def test_a_disallowed_token_is_refused_and_only_eos_remains(manager):
    matcher = manager.new_matcher(StructuredOutputsParams(json=POINT))
    assert not matcher.accept(ord("x"))
    assert allowed(manager, matcher) == {EOS}  # never an all -inf row: the sequence can still end


def test_batch_masks_rows_with_matchers_and_leaves_none_rows_untouched(manager):
    at_start = manager.new_matcher(StructuredOutputsParams(json=POINT))
    in_number = manager.new_matcher(StructuredOutputsParams(json=POINT))
    assert walk(in_number, '{"x": 12')
    choice = manager.new_matcher(StructuredOutputsParams(choice=["yes", "no"]))
    logits = torch.randn(5, 300)
    before = logits.clone()
    manager.apply_masks(logits, [at_start, None, in_number, choice, None])
    assert torch.equal(logits[1], before[1]) and torch.equal(logits[4], before[4])
    for row, matcher in ((0, at_start), (2, in_number), (3, choice)):
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == allowed(manager, matcher)
        assert torch.equal(logits[row, sorted(finite)], before[row, sorted(finite)])  # kept values unchanged
    assert set(torch.isfinite(logits[2]).nonzero().flatten().tolist()) == {*b"0123456789", ord(","), ord(" "),
                                                                           ord("\t"), ord("\n"), ord("\r")}
    assert set(torch.isfinite(logits[3]).nonzero().flatten().tolist()) == {ord("y"), ord("n")}
    assert torch.isinf(logits[[0, 2, 3], 256:]).all()  # padded model columns are never grammatical


def test_non_contiguous_logits_are_masked_in_place(manager):
    wide = torch.zeros(2, 600)
    logits = wide[:, :300]  # a column slice: not contiguous
    manager.apply_masks(logits, [manager.new_matcher(StructuredOutputsParams(choice=["a"])), None])
    assert set(torch.isfinite(wide[0, :300]).nonzero().flatten().tolist()) == {ord("a")}
    assert torch.isfinite(wide[1]).all() and torch.isfinite(wide[0, 300:]).all()


def test_regex_choice_and_ebnf_grammars_walk_and_terminate(manager):
    cases = [
        (StructuredOutputsParams(regex=r"[A-Z]{3}-\d{2}"), "ABC-12", "ABC-1x"),
        (StructuredOutputsParams(choice=["red", "green", 'quo"te']), 'quo"te', "gray"),
        (StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'), "(1+23)", "(1-"),
        (StructuredOutputsParams(grammar='start: "a" b\nb: "b"+'), None, "ac"),  # Lark is read too
    ]
    for params, good, bad in cases:
        if good is not None:
            matcher = manager.new_matcher(params)
            assert walk(matcher, good), params
            assert EOS in allowed(manager, matcher), params
            assert matcher.accept(EOS) and matcher.is_terminated(), params
        assert not walk(manager.new_matcher(params), bad), params


def test_json_object_accepts_any_object_and_nothing_else(manager):
    params = StructuredOutputsParams(json_object=True)
    matcher = manager.new_matcher(params)
    assert walk(matcher, '{"a": [1, {"b": null}], "c": "d"}') and matcher.is_terminated()
    assert not walk(manager.new_matcher(params), "[1]")


def test_whitespace_is_bounded_and_can_be_disabled(manager):
    flexible = StructuredOutputsParams(json=POINT)
    assert walk(manager.new_matcher(flexible), '{\n  "x" : 1,\n  "y": 2\n}')
    matcher = manager.new_matcher(flexible)
    assert walk(matcher, "{" + " " * 20)
    assert not matcher.accept(ord(" "))  # a random model cannot spin on whitespace forever
    compact = StructuredOutputsParams(json=POINT, disable_any_whitespace=True)
    assert walk(manager.new_matcher(compact), '{"x":1,"y":2}')
    assert not walk(manager.new_matcher(compact), '{"x": 1')


def test_every_eos_id_ends_a_complete_grammar():
    manager = StructuredOutputManager(byte_tokenizer(), vocab_size=256, eos_token_ids={EOS, 255})
    matcher = manager.new_matcher(StructuredOutputsParams(choice=["ok"]))
    assert walk(matcher, "ok")
    assert allowed(manager, matcher, 256) == {EOS, 255}


def test_compiled_grammars_are_cached_by_content_with_lru_eviction():
    manager = StructuredOutputManager(byte_tokenizer(), vocab_size=256, eos_token_ids={EOS}, cache_size=2)
    manager.validate(StructuredOutputsParams(json=POINT))
    reordered = json.loads(json.dumps(dict(reversed(list(POINT.items())))))
    for _ in range(3):
        manager.new_matcher(StructuredOutputsParams(json=reordered))  # same schema, other key order: a hit
    assert (manager.cache_misses, manager.cache_hits) == (1, 3)
    manager.validate(StructuredOutputsParams(regex="a+"))
    manager.validate(StructuredOutputsParams(regex="b+"))  # evicts the schema, the least recently used
    manager.validate(StructuredOutputsParams(regex="a+"))
    assert manager.cache_misses == 3
    manager.validate(StructuredOutputsParams(json=POINT))
    assert manager.cache_misses == 4
    assert StructuredOutputsParams(json=POINT).cache_key() != StructuredOutputsParams(
        json=POINT, disable_any_whitespace=True).cache_key()


def test_matchers_from_one_compiled_grammar_are_independent(manager):
    params = StructuredOutputsParams(choice=["ab", "ac"])
    first, second = manager.new_matcher(params), manager.new_matcher(params)
    assert walk(first, "ab") and first.is_terminated()
    assert not second.is_terminated() and allowed(manager, second) == {ord("a")}


@pytest.mark.parametrize(
    ("params", "named"),
    [
        (dict(json='{"type": "object", "properties": '), "not valid JSON"),
        (dict(json="[1, 2]"), "must be a JSON object"),
        (dict(json={"type": "objekt"}), "malformed at type"),
        (dict(json={"type": "object", "properties": {"a": {"minLength": "three"}}}), "malformed at properties/a"),
        (dict(json={"type": "object", "if": {"required": ["a"]}, "then": {}}), "cannot be enforced: if, then"),
        (dict(json={"not": {"type": "string"}}), "cannot be enforced: not"),
        (dict(json={"type": "string", "format": "no-such-format"}), "Unknown format"),
        (dict(json={"$ref": "#/$defs/missing"}), "does not exist"),
        (dict(json={"type": "string", "minLength": 3, "maxLength": 1}), "Unsatisfiable"),
        (dict(regex="[a-"), "regex cannot be used: unclosed character class"),
        (dict(regex="(?=a)b"), "look-around"),
        (dict(regex="ab\\"), "regex ends in a lone backslash"),  # llguidance read it as nothing: empty outputs
        (dict(choice=["ok", "a\ud800"]), "choice 1 is not valid Unicode (surrogates not allowed)"),
        (dict(regex="[^\\s\\S]"), "regex matches no text"),
        (dict(grammar='root ::= "a" missing'), "grammar cannot be used: Rule 'missing' not found"),
        (dict(grammar="root ::= ( "), "grammar cannot be used: Expected ')'"),
    ],
)
def test_bad_constraints_raise_invalid_request_naming_the_problem(manager, params, named):
    with pytest.raises(InvalidRequest, match="structured-output") as error:
        manager.validate(StructuredOutputsParams(**params))
    assert named in str(error.value)
    assert "\n" not in str(error.value)


def test_a_slow_tokenizer_is_refused_with_a_sentence():
    with pytest.raises(InvalidRequest, match="fast"):
        StructuredOutputManager(object(), vocab_size=256, eos_token_ids={EOS})


def test_bpe_tokens_spanning_grammar_pieces_are_allowed():
    """With merges, one token may cover several grammar symbols (`{"`, `name"`); the mask must allow exactly those
    tokens whose whole byte string continues the document, and a real tokenization must walk through."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"name": f"n{i}", "value": i * 7, "ok": i % 2 == 0}) for i in range(300)]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    manager = StructuredOutputManager(tokenizer, vocab_size=len(tokenizer), eos_token_ids={tokenizer.eos_token_id})
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "value": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "value", "ok"], "additionalProperties": False}
    document = json.dumps({"name": "n42", "value": 294, "ok": True})
    ids = tokenizer(document, add_special_tokens=False).input_ids
    assert len(ids) < len(document)  # merges happened
    matcher = manager.new_matcher(StructuredOutputsParams(json=schema))
    for token in ids:
        assert token in allowed(manager, matcher, len(tokenizer))
        assert matcher.accept(token)
    assert matcher.is_terminated()
    start = allowed(manager, manager.new_matcher(StructuredOutputsParams(json=schema)), len(tokenizer))
    assert all(tokenizer.decode([t]).lstrip().startswith("{") or not tokenizer.decode([t]).strip()
               for t in start)
    assert any(len(tokenizer.decode([t])) > 1 and tokenizer.decode([t]).strip().startswith("{") for t in start)
