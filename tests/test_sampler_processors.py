"""The sampler's per-row processors on hand-made logits, without a model: vLLM's order (allowed tokens, min_tokens,
logit bias, then penalties), each row on its own whatever the others ask for, and greedy's first-maximum rule."""

import torch

from paged_backend.engine.request import Request, Sequence
from paged_backend.engine.sampler import Sampler
from paged_backend.engine.sampling_params import SamplingParams

VOCAB = 8


def sequence(prompt: list[int], **params) -> Sequence:
    return Sequence(Request("r", None, prompt, SamplingParams(temperature=0, max_tokens=4, **params)), 0)


def test_rows_take_their_own_processors_in_vllms_order():
    logits = torch.zeros(4, VOCAB)
    logits[:, 0], logits[:, 1] = 2.0, 1.5
    seqs = [
        # token 0 is in the prompt: bias first, (2 + 2) / 4 = 1.0 < 1.5, so token 1 (penalty first: 2 / 4 + 2 = 2.5)
        sequence([0], logit_bias={0: 2.0}, repetition_penalty=4.0),
        sequence([3], allowed_token_ids=[5, 6], logit_bias={6: 0.5, 0: 9.0}),  # bias cannot revive a masked id
        sequence([3]),  # nothing to process: the first of the largest logits
        sequence([3], min_tokens=2, stop_token_ids=[0], logit_bias={1: -3.0, 2: 0.25}),
    ]
    tokens, _ = Sampler(eos_token_ids={7})(logits, seqs)
    assert tokens == [1, 6, 0, 2]


def test_a_row_the_rules_leave_empty_keeps_its_allowed_tokens_and_the_others_are_untouched():
    """min_tokens blocks the only allowed tokens here: sampling from nothing would fail the whole step."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 1.0
    stuck = dict(allowed_token_ids=[5, 6], stop_token_ids=[5, 6], min_tokens=2, logit_bias={6: 1.0})
    seqs = [sequence([3], **stuck), sequence([3], **stuck), sequence([3])]
    seqs[1].request.params = SamplingParams(temperature=1.0, seed=0, max_tokens=4, **stuck)
    tokens, _ = Sampler(eos_token_ids={7})(logits, seqs)
    assert tokens == [6, tokens[1], 2] and tokens[1] in (5, 6)  # greedy: the bias decides; sampled: an allowed one


def test_greedy_takes_the_first_of_tied_maxima():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    tokens, _ = Sampler(eos_token_ids={0})(logits, [sequence([1]), sequence([1])])
    assert tokens == [1, 0]
