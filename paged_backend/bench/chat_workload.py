"""`--dataset chat`: real chat traffic for a real model. Varied user questions, each asked in a few styles (short,
open, listed) so that answers have a spread of natural lengths, laid out by the model's chat template, in a seeded
shuffled order. Each request is capped at `max_tokens` and meant to end at the model's own EOS.
"""

from __future__ import annotations

import random

from paged_backend.engine.chat_template import render_chat
from paged_backend.errors import InvalidRequest

CHAT_DATASET = "chat"  # the `--dataset` value that selects this workload

QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "What is the boiling point of water at sea level in Celsius?",
    "Who wrote the play Romeo and Juliet?",
    "What is 12 times 7?",
    "How do plants make their food?",
    "What is the largest planet in our solar system?",
    "Write a Python function that reverses a string.",
    "What is the difference between a list and a tuple in Python?",
    "How does a refrigerator keep food cold?",
    "What causes the seasons on Earth?",
    "Suggest a name for a friendly orange cat.",
    "How can I improve my sleep?",
    "What is photosynthesis?",
    "Translate 'good morning' into Spanish.",
    "What is the speed of light?",
    "Why do we have leap years?",
    "What are the primary colors?",
    "How do vaccines work?",
    "What is the tallest mountain in the world?",
    "Explain what a black hole is.",
    "What is the chemical symbol for gold?",
    "How many continents are there, and what are they?",
    "Give me a tip for learning a new language.",
    "What does a CPU do in a computer?",
    "Why do leaves change color in autumn?",
    "What is the square root of 144?",
    "How do bees make honey?",
    "What is the main ingredient of guacamole?",
    "Write a haiku about the ocean.",
    "What is gravity?",
)
STYLES = ("{} Answer in one sentence.", "{}", "{} Answer with three short bullet points.")


def chat_workload(tokenizer, num_requests: int | None, seed: int, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """`num_requests` distinct chat prompts as token ids (all of them when None) and each one's cap."""
    available = len(QUESTIONS) * len(STYLES)
    count = available if num_requests is None else num_requests
    if not 0 < count <= available:
        raise InvalidRequest(f"--dataset {CHAT_DATASET} holds {available} distinct prompts; "
                             f"give --num-requests between 1 and {available}")  # fmt: skip
    if max_tokens < 1:
        raise InvalidRequest(f"--max-tokens must be at least 1 (got {max_tokens})")
    texts = [style.format(question) for style in STYLES for question in QUESTIONS]
    random.Random(seed).shuffle(texts)
    prompts = [render_chat(tokenizer, [{"role": "user", "content": text}]) for text in texts[:count]]
    return prompts, [max_tokens] * count
