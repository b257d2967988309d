"""TGI's token semantics on the engine's rules: token texts, EOS ids and stopping criteria for every TGI path.

The rules themselves (incremental detokenization, EOS ids, stop checks) are the engine's (`engine/detokenizer.py`,
`engine/stopping.py`); this module picks TGI's choices among them, so the HTTP face, the reference backend and the
gRPC shard agree with TGI's server (`Model.decode_token`, `StoppingCriteria`) on token texts and finish reasons.
"""

from __future__ import annotations

from paged_backend.engine import detokenizer
from paged_backend.engine.detokenizer import IncrementalDetokenizer
from paged_backend.engine.stopping import StopRules
from paged_backend.tgi.backends.base import FinishReason
from paged_backend.tgi.backends.sampling import finish_reason


class TokenTexts:
    """The text of each new token of one request, special tokens kept (TGI shows them)."""

    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.detokenizer = IncrementalDetokenizer.after_prompt(len(self.ids), skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self.detokenizer.next_text(self.tokenizer, self.ids)


def token_text(tokenizer, token_id: int) -> str:
    """One token's text on its own, special tokens shown: prefill and top tokens, which no stream decodes."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def generated_text(tokenizer, token_ids: list[int]) -> str:
    """TGI's `generated_text`: the generated tokens decoded at once, special tokens skipped."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def eos_token_ids(tokenizer, generation_config=None) -> set[int]:
    """TGI's EOS ids: the generation config's (may be a list), else the tokenizer's."""
    return detokenizer.eos_token_ids(tokenizer, generation_config, union=False)


class StoppingCriteria:
    """Decides after each token, in TGI's order: length first, then EOS, then stop sequences at the text's end."""

    _KEEP_CHARS, _TRIM_AT = 200, 300  # TGI keeps only a tail of the text to match stop sequences against

    def __init__(
        self, eos_ids: set[int], stop_sequences: tuple[str, ...], max_new_tokens: int, ignore_eos: bool = False
    ) -> None:
        self.rules = StopRules(
            max_tokens=max_new_tokens, eos_token_ids=() if ignore_eos else eos_ids, stop=tuple(stop_sequences),
            length_first=True, stop_at_end=True,
        )  # fmt: skip
        self.current_tokens = 0
        self.current_output = ""

    def __call__(self, token_id: int, token_text: str) -> FinishReason | None:
        self.current_tokens += 1
        if self.rules.stop:
            self.current_output += token_text
            if len(self.current_output) > self._TRIM_AT:
                self.current_output = self.current_output[-self._KEEP_CHARS :]
        stop = self.rules.check(token_id, self.current_output, token_text, self.current_tokens)
        return None if stop is None else finish_reason(stop.reason, stop.stop_reason)
