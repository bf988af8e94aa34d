"""Tasks: the toy reasoning world and file datasets. The types a task hands the algorithm
(`Problem`, `TaskSplits`, `TaskProbe`) and the prompt template are the algorithm's own
(`omgrpo.core.task`, `omgrpo.core.prompt`), re-exported here.

A task yields `Problem`s split into train / val / test. `load_task(cfg)` picks one by name;
`check_prompt_lengths` checks at setup that every prompt fits `rollout.max_prompt_len`.
"""

from omgrpo.core.prompt import SYSTEM_PROMPT, build_messages, render_prompt
from omgrpo.core.task import Problem, TaskProbe, TaskSplits
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
