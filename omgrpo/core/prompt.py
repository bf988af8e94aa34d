"""The paper's prompt template (appendix): the one renderer of rollout, CAR and SFT prompts."""

from __future__ import annotations

from typing import Any

# The paper's system prompt (appendix, prompt template), used for every model.
SYSTEM_PROMPT = "Let's think step by step and output the final answer within \\boxed{}."


def build_messages(question: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    """Chat messages of the paper's template: the system instruction, then the question."""
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": question},
    ]


def render_prompt(tokenizer: Any, question: str, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The prompt text of a question: the paper's messages through the tokenizer's chat template,
    ending in an open assistant turn; base models without a template get the same content as
    plain text. The one renderer of rollout, CAR and SFT prompts."""
    messages = build_messages(question, system_prompt)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system_prompt}\n\n{question}\n"
