"""`LLM`: offline batch generation on top of `Engine` (vLLM's `LLM`), and `engine_config` for its flat options."""

from __future__ import annotations

import itertools
import threading
import time

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from paged_backend.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from paged_backend.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search_output
from paged_backend.engine.chat_template import render_chat
from paged_backend.engine.engine import Engine
from paged_backend.engine.input_processor import prompt_list
from paged_backend.engine.request import RequestOutput
from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.engine.sleep import EngineSleep
from paged_backend.errors import InvalidRequest
from paged_backend.lora import LoRARequest


class LLM:
    """Offline batch generation on top of `Engine`.

    >>> llm = LLM("paged-backend/embedded-tiny", device="cpu", num_blocks=64)
    >>> [out] = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    >>> len(out.outputs[0].token_ids)
    3
    """

    def __init__(
        self,
        model: str | PreTrainedModel | None = None,
        *,
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        enable_sleep_mode: bool = False,  # vLLM's scripts pass it to call sleep(); nothing here needs setting up
        **engine_kwargs,
    ) -> None:
        del enable_sleep_mode
        objects = not (model is None or isinstance(model, str))
        config = engine_config(model=None if objects else model,
                               tokenizer=None if objects or tokenizer is None else tokenizer, **engine_kwargs)
        self.engine = Engine(config, model=model if objects else None, tokenizer=tokenizer if objects else None)
        self._ids = itertools.count()
        # One generate() at a time: each steps the engine until its own requests finish, and two stepping it from
        # two threads tore its block tables apart (KeyError in the block manager). AsyncEngine serves concurrency.
        self._running = threading.Lock()
        self._sleep = EngineSleep(self.engine)

    @property
    def llm_engine(self) -> Engine:
        """vLLM's name for the engine underneath."""
        return self.engine

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer prompts are tokenized and outputs detokenized with (vLLM's call)."""
        return self.engine.tokenizer

    def set_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Tokenize prompts, detokenize outputs and read the EOS ids with `tokenizer` from the next generate on
        (vLLM's call). Its ids must be the model's: nothing is re-embedded."""
        with self._running:
            self.engine.set_tokenizer(tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults: SamplingParams() with the sampling fields the generation config sets (temperature, top_p,
        top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens; `generation_config` /
        `override_generation_config` choose it); what generate and chat use when given no sampling params."""
        return SamplingParams(**self.engine.sampling_defaults)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (`engine.sleep`): level 1 frees the KV pool, level 2 the weights too, until `wake_up`.
        Every cached prefix is forgotten."""
        with self._running:
            self._sleep.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `sleep` freed, or only `tags` ("weights", "kv_cache"); level 2 reloads the weights from
        the model the LLM was built with."""
        with self._running:
            self._sleep.wake_up(tags)

    def generate(
        self,
        prompts: str | dict | list,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        priority: list[int] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is text, a list of token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": [ids]}; `prompts` is
        one prompt or a list of them. `priority` (one per prompt, smaller first) matters with the "priority"
        scheduling policy. `lora_request`: one adapter for all prompts, or one (or None for the base model) per prompt.
        """
        prompts = prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest(f"{len(params)} sampling params for {len(prompts)} prompts; give one or one each")
        priority = priority or [0] * len(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequest(f"{len(loras)} lora requests for {len(prompts)} prompts; give one or one each")
        with self._running:
            if self._sleep.level:  # a step would run on a released pool (or a model with no weights)
                raise InvalidRequest(f"the engine is asleep (level {self._sleep.level}); call wake_up() first")
            return self._add_and_run(prompts, params, priority, loras, use_tqdm)

    def beam_search(
        self,
        prompts: str | dict | list,
        params: BeamSearchParams,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the `params.beam_width` best beams of each prompt, best first. Each sequence's
        `tokens` and `text` include the prompt; its `logprobs` hold each step's 2 x width candidates. The beams share
        their KV blocks in the engine (`engine/beam_search.py`)."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequest(f"params must be BeamSearchParams, got {type(params).__name__}")
        outputs = self.generate(prompts, params.sampling_params(), use_tqdm=use_tqdm, lora_request=lora_request)
        return [beam_search_output(output, self.engine.tokenizer) for output in outputs]

    def _add_and_run(self, prompts, params, priority, loras, use_tqdm: bool) -> list[RequestOutput]:
        ids: list[str] = []
        try:
            for prompt, param, rank, lora in zip(prompts, params, priority, loras, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, param, priority=rank, lora_request=lora)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # all or nothing: a bad prompt leaves no half-queued batch behind
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: list[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a list of them, each
        laid out by the chat template (`chat_template`, else the tokenizer's) and generated as `generate` does."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [
            {"prompt_token_ids": render_chat(
                tokenizer, [_text_content(message) for message in conversation], tools=tools, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )}
            for conversation in conversations
        ]  # fmt: skip
        outputs = self.generate(prompts, sampling_params, priority=priority, use_tqdm=use_tqdm, lora_request=lora_request)
        for output in outputs:  # vLLM's chat outputs carry the prompt the template wrote
            output.prompt = tokenizer.decode(output.prompt_token_ids)
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (vLLM's call), e.g. after the model's weights changed: cached blocks hold
        KV computed with the old ones. Running sequences keep their blocks."""
        self.engine.block_manager.reset_prefix_cache()
        return True

    def kv_map(self, path: str = "kv_map.png", *, title: str = "KV pool"):
        """Draw the pool now as `path` (PNG) and the same name with .html; see `paged_backend.core.kv_map`."""
        from paged_backend.core.kv_map import draw_kv_map

        return draw_kv_map(self.engine.kv_snapshot(), path, title=title)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = _progress(len(ids)) if use_tqdm else None
        generated, started = 0, time.perf_counter()
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    generated += 1
                    if output.finished:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
                if progress is not None:
                    progress.set_postfix_str(f"{generated / (time.perf_counter() - started):.1f} tok/s")
        except BaseException:
            # A failed step (or Ctrl-C) fails this batch: abort what is left so its blocks are free and the
            # next generate() starts clean instead of resuming half-stepped requests.
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in ids]


def _text_content(message: dict) -> dict:
    """A message whose content is OpenAI's list of parts, as one string: text parts joined by newlines, as vLLM
    does for string templates (the template printed the list's Python repr)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "refusal") or not isinstance(part.get(kind), str):
            raise InvalidRequest(f"a {message.get('role', 'message')} content part must be {{'type': 'text', "
                                 f"'text': ...}}, got {part!r:.80}; this engine reads text only")  # fmt: skip
        texts.append(part[kind])
    return {**message, "content": "\n".join(texts)}


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)


def engine_config(**kwargs) -> EngineConfig:
    """Build an `EngineConfig` from flat keyword arguments (vLLM style: `block_size=16, max_num_seqs=64`).

    >>> engine_config(block_size=8, max_num_seqs=4).scheduler.max_num_seqs
    4
    >>> engine_config(scheduling_policy="priority").scheduler.policy  # vLLM's keyword for the policy
    'priority'
    """
    from paged_backend.engine.args import option_fields

    spellings = option_fields()
    kwargs = {spellings.get(key, key): value for key, value in kwargs.items()}  # vLLM's spellings: kv_cache_dtype
    groups = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}
    nested = {name: cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in cls.model_fields})
              for name, cls in groups.items()}
    unknown = set(kwargs) - set(EngineConfig.model_fields)
    if unknown:
        raise InvalidRequest(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    return EngineConfig(**nested, **kwargs)
