"""Tasks: the toy reasoning world, file datasets, and the prompt template.

A task yields `Problem`s split into train / val / test. `load_task(cfg)` picks one by name;
`check_prompt_lengths` checks at setup that every prompt fits `rollout.max_prompt_len`.
"""

from omgrpo.tasks.base import (
    SYSTEM_PROMPT,
    Problem,
    TaskProbe,
    TaskSplits,
    build_messages,
    render_prompt,
)
from omgrpo.tasks.prompts import PromptEncoder, check_prompt_lengths
from omgrpo.tasks.registry import TASKS, load_task, task_probe

__all__ = [
    "SYSTEM_PROMPT",
    "TASKS",
    "Problem",
    "PromptEncoder",
    "TaskProbe",
    "TaskSplits",
    "build_messages",
    "check_prompt_lengths",
    "load_task",
    "render_prompt",
    "task_probe",
]
