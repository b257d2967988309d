"""Token ids to text, a token at a time, and the ids that end generation: one implementation for the engine and every
TGI path (HTTP face, reference backend, gRPC shard).

A token's text is the growth of a short decoded window (vLLM's detokenizer, TGI's `decode_token`). The window starts a
few tokens before the newest ones, so a tokenizer that merges a token with its neighbours, or drops a word's leading
space when it is decoded alone, still renders right; nothing is emitted while a UTF-8 character is incomplete.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTEXT_TOKENS = 5  # tokens decoded again before the first new one


@dataclass
class IncrementalDetokenizer:
    """Where the next decode window starts (`prefix_offset`) and how far the text was read (`read_offset`).

    It holds no token ids: each call is given the sequence's ids so far, prompt included.

    >>> from paged_backend.worker.models import byte_tokenizer
    >>> tokenizer, ids = byte_tokenizer(), list(b"hi ")
    >>> detokenizer = IncrementalDetokenizer.after_prompt(len(ids))
    >>> [detokenizer.next_text(tokenizer, ids) for ids in (ids + [0xC3], ids + [0xC3, 0xA9])]
    ['', 'é']
    """

    prefix_offset: int
    read_offset: int
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @classmethod
    def after_prompt(cls, num_prompt_tokens: int, **options) -> IncrementalDetokenizer:
        return cls(max(0, num_prompt_tokens - CONTEXT_TOKENS), num_prompt_tokens, **options)

    def next_text(self, tokenizer, ids: list[int]) -> str:
        """The text of the ids added since the text was last read; '' while a character's bytes are incomplete."""
        options = {"skip_special_tokens": self.skip_special_tokens}
        if not self.spaces_between_special_tokens:  # only slow tokenizers read it; the default is True
            options["spaces_between_special_tokens"] = False
        before = tokenizer.decode(ids[self.prefix_offset : self.read_offset], **options)
        after = tokenizer.decode(ids[self.prefix_offset :], **options)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return after[len(before) :]


def eos_token_ids(tokenizer, generation_config=None, *, union: bool = True) -> set[int]:
    """The ids that end generation (unless a request ignores EOS).

    `union=True` (vLLM's rule, the engine's): the tokenizer's EOS and every id the generation config names.
    `union=False` (TGI's server): the generation config's ids when it names any, else the tokenizer's.
    """
    configured = getattr(generation_config, "eos_token_id", None)
    sources = [tokenizer.eos_token_id, configured] if union or configured is None else [configured]
    ids: set[int] = set()
    for source in sources:
        if source is not None:
            ids.update(source if isinstance(source, list | tuple) else [source])
    return ids
