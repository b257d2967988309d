"""A conversation laid out by a chat template, as token ids: the one rendering `LLM.chat`, `run --chat` and the
server's /v1/chat/completions share, with its refusals.

A template that ignores `tools` (SmolLM2's, and many small models') would leave the model blind to the functions it
is asked to call, so their declarations go into the system message as text instead, as TGI does for such
templates.
"""

from __future__ import annotations

import json
from functools import lru_cache

from transformers import PreTrainedTokenizerBase

from paged_backend.errors import InvalidRequest, PromptTooLong, not_unicode

# apply_chat_template's own arguments: chat_template_kwargs may not override them.
TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    chat_template_kwargs: dict | None = None,
    max_model_len: int | None = None,
) -> list[int]:
    """Token ids of `messages` as the chat template (`chat_template`, else the tokenizer's) lays them out.

    With `max_model_len`, a rendering longer than that many of the tokenizer's longest tokens is refused before it
    is tokenized: it cannot fit, and a request's own template could otherwise make tokenizing take minutes.

    >>> from paged_backend.worker.models import byte_tokenizer
    >>> bytes(render_chat(byte_tokenizer(), [{"role": "user", "content": "hi"}])[1:9])
    b'user\\nhi\\xfe'
    """
    if not (chat_template or tokenizer.chat_template):
        raise InvalidRequest("this model's tokenizer has no chat template; give one (serve --chat-template, "
                             "LLM.chat(chat_template=...)) or use completions")  # fmt: skip
    if add_generation_prompt and continue_final_message:
        raise InvalidRequest(
            "continue_final_message and add_generation_prompt cannot both be true; "
            "set add_generation_prompt to false to continue the last message"
        )
    template_kwargs = dict(chat_template_kwargs or {})
    clashing = sorted(TEMPLATE_ARGUMENTS & template_kwargs.keys())
    if clashing:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(clashing)}; use the request fields")

    def render(conversation: list[dict], tools: list[dict] | None) -> str:
        try:
            return tokenizer.apply_chat_template(
                conversation, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template, tokenize=False,
                **template_kwargs,
            )  # fmt: skip
        except Exception as error:  # the template is user input too: whatever it raises is this request's fault
            raise InvalidRequest(
                f"the chat template could not render these messages: {type(error).__name__}: {error}"
            ) from error

    text = render(messages, tools)
    if tools and text == render(messages, None):  # the template dropped them: declare them in the system message
        text = render(with_tools_declared(messages, tools), None)
    if not text:
        raise InvalidRequest("the chat template rendered these messages as empty text; check the template")
    if max_model_len is not None and len(text) > max_model_len * longest_token_chars(tokenizer):
        raise PromptTooLong(f"the chat template rendered {len(text)} characters, more than max_model_len="
                            f"{max_model_len} tokens can hold; shorten the messages or the template")  # fmt: skip
    if reason := not_unicode(text):
        raise InvalidRequest(f"the messages hold text that is not valid Unicode ({reason}); send UTF-8 text")
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


@lru_cache(maxsize=16)
def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The characters of the tokenizer's longest vocabulary entry: no token covers more of a text."""
    return max(map(len, tokenizer.get_vocab()), default=1)


TOOLS_PREAMBLE = "You can call these functions; to call one, answer with its name and JSON arguments:"


def with_tools_declared(messages: list[dict], tools: list[dict]) -> list[dict]:
    r"""`messages` with the tools' declarations (one JSON object per line) in the system message.

    >>> with_tools_declared([{"role": "user", "content": "hi"}], [{"type": "function", "function": {"name": "f"}}])[0]
    {'role': 'system', 'content': 'You can call these functions; to call one, answer with its name and JSON arguments:\n{"name": "f"}'}
    """
    declared = "\n".join(json.dumps(tool.get("function", tool)) for tool in tools)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        system = {**messages[0], "content": f"{messages[0]['content']}\n\n{TOOLS_PREAMBLE}\n{declared}"}
        return [system, *messages[1:]]
    return [{"role": "system", "content": f"{TOOLS_PREAMBLE}\n{declared}"}, *messages]
