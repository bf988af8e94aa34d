"""Questions -> prompt token ids through the model's chat template, and the setup-time check
that every prompt a run can draw fits `rollout.max_prompt_len`."""

from __future__ import annotations

from omgrpo.core.prompt import SYSTEM_PROMPT, render_prompt
from omgrpo.core.task import Problem, TaskSplits

SHOWN_ROWS = 10  # over-long prompts listed by name in the setup error


class PromptEncoder:
    """Question -> prompt token ids through the model's chat template (paper's template);
    token ids are cached per question."""

    def __init__(self, tokenizer, max_len: int, system_prompt: str = SYSTEM_PROMPT):
        self.tokenizer, self.max_len, self.cache = tokenizer, max_len, {}
        self.system_prompt = system_prompt  # evaluation suites may set their own

    def tokens(self, question: str) -> list[int]:
        """The prompt's token ids, whatever their length."""
        if question not in self.cache:
            text = render_prompt(self.tokenizer, question, self.system_prompt)
            self.cache[question] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.cache[question]

    def __call__(self, problem: Problem) -> list[int]:
        ids = self.tokens(problem.question)
        if len(ids) > self.max_len:
            raise ValueError(
                f"{_name(problem)}: prompt has {len(ids)} tokens, more than "
                f"rollout.max_prompt_len={self.max_len}"
            )
        return ids


def check_prompt_lengths(
    splits: TaskSplits, encode: PromptEncoder, paraphrases: bool = False
) -> None:
    """Raise a ValueError listing every train / val prompt (and, for CoReward, paraphrase)
    longer than `encode.max_len` tokens, so a run fails at setup instead of hours in, when the
    row is first drawn. Tokenizes each prompt once (the encoder caches it for training)."""
    texts: list[tuple[str, Problem, str]] = []
    for split, problems in (("train", splits.train), ("val", splits.val)):
        for p in problems:
            texts.append((split, p, p.question))
            if paraphrases and p.paraphrase is not None:
                texts.append((split, p, p.paraphrase))
    lengths = [(split, p, len(encode.tokens(text))) for split, p, text in texts]
    too_long = [(split, p, n) for split, p, n in lengths if n > encode.max_len]
    if not too_long:
        return
    lines = [f"  {split}: {_name(p)}: {n} tokens" for split, p, n in too_long[:SHOWN_ROWS]]
    if len(too_long) > SHOWN_ROWS:
        lines.append(f"  ... and {len(too_long) - SHOWN_ROWS} more")
    raise ValueError(
        f"{len(too_long)} of {len(texts)} prompts are longer than rollout.max_prompt_len="
        f"{encode.max_len} tokens (chat template included):\n"
        + "\n".join(lines)
        + "\nraise rollout.max_prompt_len or remove these rows"
    )


def _name(problem: Problem) -> str:
    source = problem.meta.get("source")
    return f"{source} (id {problem.id})" if source else f"problem {problem.id}"
