"""Problem container and the paper's prompt template."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

# The paper's system prompt (appendix, prompt template), used for every model.
SYSTEM_PROMPT = "Let's think step by step and output the final answer within \\boxed{}."


@dataclass(frozen=True)
class Problem:
    """One question with its (optional) label.

    `answer` is the ground truth; label-free methods never train on it, it is only used by the
    `gt` reward and by diagnostics. `solution` is a worked chain of thought (toy world only, for
    the SFT warm start). `paraphrase` is a meaning-preserving rewording (CoReward).
    """

    id: str
    question: str
    answer: str | None
    solution: str | None = None
    paraphrase: str | None = None
    meta: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class TaskSplits:
    train: list[Problem]
    val: list[Problem]
    test: list[Problem]


class TaskProbe(Protocol):
    """The hook through which scoring reads task-specific structure in a response, so that
    `omgrpo/core` names no task (`omgrpo.tasks.task_probe(cfg.task)` gives the configured
    task's; the toy world's is `omgrpo.tasks.toy.ToyProbe`)."""

    peak: str | None
    """An answer whose batch share is a diagnostic (`answers/peak_share`); None: not logged."""

    def result_span(self, text: str) -> tuple[int, int] | None:
        """Character span of the value the reasoning computed last (the `result` token role);
        None: no such value."""
        ...

    def is_guess(self, text: str, answer: str | None) -> bool:
        """Whether the boxed `answer` is not what the reasoning computed (guess diagnostics)."""
        ...


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
