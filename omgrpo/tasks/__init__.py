"""Tasks: the toy reasoning world, file datasets, and the prompt template.

A task yields `Problem`s split into train / val / test. `load_task(cfg)` picks one by name.
"""

from omgrpo.tasks.base import SYSTEM_PROMPT, Problem, TaskSplits, build_messages, render_prompt
from omgrpo.tasks.registry import TASKS, load_task

__all__ = [
    "SYSTEM_PROMPT",
    "TASKS",
    "Problem",
    "TaskSplits",
    "build_messages",
    "load_task",
    "render_prompt",
]
