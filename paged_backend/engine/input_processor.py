"""Input processing (vLLM V1's Processor): a prompt in any of vLLM's forms plus its sampling, LoRA and structured-output
options, checked and tokenized into a `Request`. Bad input raises here, before anything is queued."""

from __future__ import annotations

import itertools

from paged_backend.config import EngineConfig
from paged_backend.engine.request import REQUEST_CLASSES, Request, RequestClass, Sequence
from paged_backend.engine.sampler import Sampler
from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.engine.stopping import StopRules
from paged_backend.errors import InvalidRequest, PromptTooLong
from paged_backend.lora import LoRARequest

PROMPT_FORMS = "text, a list of token ids, {'prompt': text} or {'prompt_token_ids': [token ids]}"
PROMPT_KEYS = {"prompt", "prompt_token_ids"}


def prompt_list(prompts) -> list:
    """One prompt, or a list of them, as a list of prompts."""
    if isinstance(prompts, str | dict):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise InvalidRequest(f"prompts must be a prompt or a list of prompts; a prompt is {PROMPT_FORMS}")
    return [prompts] if prompts and isinstance(prompts[0], int) else list(prompts)


def split_prompt(prompt, prompt_token_ids=None) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a prompt given as text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}.

    >>> split_prompt({"prompt_token_ids": [1, 2]})
    (None, [1, 2])
    """
    text = prompt
    if isinstance(prompt, dict):
        if not prompt or set(prompt) - PROMPT_KEYS:
            raise InvalidRequest(f"a prompt dict holds 'prompt' (text) and/or 'prompt_token_ids' (a list of token "
                                 f"ids), got the keys {sorted(map(str, prompt))}")  # fmt: skip
        if prompt_token_ids is not None and "prompt_token_ids" in prompt:
            raise InvalidRequest("prompt_token_ids were given twice (in the prompt dict and as an argument); give one")
        text, prompt_token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids", prompt_token_ids)
    elif isinstance(prompt, list | tuple):
        if prompt_token_ids is not None:
            raise InvalidRequest("token ids were given twice (as the prompt and as prompt_token_ids); give one")
        text, prompt_token_ids = None, prompt
    if text is not None and not isinstance(text, str):
        raise InvalidRequest(f"a prompt is {PROMPT_FORMS}; got {type(text).__name__}")
    if prompt_token_ids is not None and not isinstance(prompt_token_ids, list | tuple):
        raise InvalidRequest(f"prompt_token_ids must be a list of token ids, got {type(prompt_token_ids).__name__}")
    return text, None if prompt_token_ids is None else list(prompt_token_ids)


class InputProcessor:
    """Turns what a caller asks for into a `Request` the scheduler can take."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: set[int],
        sampler: Sampler,
        lora=None,
    ) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.eos_token_ids = eos_token_ids
        self.sampler, self.lora = sampler, lora  # the sampler holds the structured-output manager once one is built
        self._arrivals = itertools.count()

    def process(
        self,
        request_id: str,
        prompt=None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        request_class: RequestClass = "interactive",
    ) -> Request:
        """A request with its first sequence (siblings are forked once the prompt is in the pool)."""
        params = params or SamplingParams()
        if request_class not in REQUEST_CLASSES:
            raise InvalidRequest(f"request_class must be one of {', '.join(REQUEST_CLASSES)}, got {request_class!r}")
        if params.num_sequences > self.max_num_seqs:
            raise InvalidRequest(f"n={params.num_sequences} (best_of included) exceeds max_num_seqs="
                                 f"{self.max_num_seqs}; lower n / best_of or raise max_num_seqs")  # fmt: skip
        prompt, prompt_token_ids = split_prompt(prompt, prompt_token_ids)
        prompt_token_ids = self._prompt_token_ids(prompt, prompt_token_ids, params)
        vocab = self.vocab_size
        named_ids = (("allowed_token_ids", params.allowed_token_ids), ("logit_bias", params.logit_bias),
                     ("stop_token_ids", params.stop_token_ids))  # fmt: skip
        for name, ids in named_ids:
            if ids is not None and not all(0 <= t < vocab for t in ids):
                outside = str(next(t for t in ids if not 0 <= t < vocab))
                raise InvalidRequest(f"{name} must name token ids in [0, {vocab})"
                                     + (f", got {outside}" if len(outside) <= 20 else ""))  # fmt: skip
        for name, count in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if count is not None and count > vocab:  # (a step would fail for every request in it)
                raise InvalidRequest(f"{name}={count} asks for more alternatives than the vocabulary's {vocab} tokens")
        # Compiling the constraint here refuses a bad one before anything is queued.
        grammar = self.grammar_matcher(params)
        scoring_only = params.max_tokens == 0  # prompt logprobs alone: nothing follows the prompt, which may fill it
        if len(prompt_token_ids) >= self.max_model_len + scoring_only:
            raise PromptTooLong(
                f"prompt has {len(prompt_token_ids)} tokens but max_model_len is {self.max_model_len} "
                f"(prompt plus at least one generated token): shorten the prompt or raise max_model_len, the KV "
                f"pool, or (without chunked prefill) max_num_batched_tokens"
            )
        bad_words = self._bad_words_token_ids(params.bad_words or [])
        self._check_a_token_is_left(params, bad_words)
        adapter = self._lora_adapter(lora_request)
        request = Request(request_id, prompt, prompt_token_ids, params, priority, next(self._arrivals), request_class)
        request.lora_adapter = adapter
        request.bad_words_token_ids = bad_words
        request.stop_rules = StopRules.of(params, self.eos_token_ids, self.max_model_len)
        request.seqs.append(Sequence(request, 0))
        request.seqs[0].grammar = grammar
        return request

    def _prompt_token_ids(self, prompt: str | None, prompt_token_ids: list[int] | None, params) -> list[int]:
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequest("give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        if params.truncate_prompt_tokens is not None:
            prompt_token_ids = prompt_token_ids[-params.truncate_prompt_tokens :]
        if not prompt_token_ids:
            raise InvalidRequest("prompt is empty; give at least one token of prompt")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidRequest(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
        return list(prompt_token_ids)

    def grammar_matcher(self, params: SamplingParams):
        """A fresh structured-output matcher for the request's constraint (None without one)."""
        return None if params.structured_outputs is None else self.structured().new_matcher(params.structured_outputs)

    def structured(self):
        """The structured-output manager, built on first use (the grammar backend is imported only then)."""
        if self.sampler.structured is None:
            try:
                from paged_backend.structured.manager import StructuredOutputManager
            except ImportError as error:
                raise InvalidRequest(
                    f"structured outputs need the grammar engine, which is not installed ({error}); "
                    "install paged-backend[structured]"
                ) from error

            self.sampler.structured = StructuredOutputManager(
                self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids
            )
        return self.sampler.structured

    def _lora_adapter(self, lora_request: LoRARequest | None):
        if lora_request is None:
            return None
        if self.lora is None:
            raise InvalidRequest(f"LoRA adapter {lora_request.lora_name!r} asked for but LoRA is disabled; "
                                 "start the engine with enable_lora=True (--enable-lora)")  # fmt: skip
        return self.lora.load(lora_request)

    def _check_a_token_is_left(self, params: SamplingParams, bad_words: list[list[int]]) -> None:
        """Refuse allowed_token_ids that the other rules ban outright: the first token would have nothing to come from."""
        if params.allowed_token_ids is None:
            return
        left = set(params.allowed_token_ids) - {word[0] for word in bad_words if len(word) == 1}
        if not left:
            raise InvalidRequest("bad_words ban every token in allowed_token_ids; allow another token or drop "
                                 "those bad words")  # fmt: skip
        if params.min_tokens and left <= set(self.sampler.ending_ids(params)):
            raise InvalidRequest(f"min_tokens={params.min_tokens} cannot be met: every token allowed_token_ids "
                                 f"leaves ends the sequence (EOS or stop_token_ids); allow another token or drop "
                                 f"min_tokens")  # fmt: skip

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (its mid-sentence form), as vLLM bans them."""
        banned: list[list[int]] = []
        for word in words:
            for form in (word, " " + word.lstrip()):
                ids = self.tokenizer(form, add_special_tokens=False).input_ids
                if ids and ids not in banned:
                    banned.append(ids)
        return banned
