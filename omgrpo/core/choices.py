"""The names of the algorithm's choices that the config validates (`omgrpo.config`): here,
without torch, so that the verbs which only read runs (report, study-report, the sweep planner)
compose and check a config without importing it. Their implementations: `omgrpo.core.losses`
(the aggregation modes) and `omgrpo.core.spans` (the answer spans)."""

from __future__ import annotations

__all__ = ["AGG_MODES", "ANSWER_SPANS"]

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
"""`algorithm.agg`: how per-token losses become one (`omgrpo.core.losses.agg_loss`)."""

ANSWER_SPANS = ("boxed", "closing", "closing_line", "closing_only")
"""`algorithm.answer_span` values: `boxed` (the paper's span, the content of the last
``\\boxed{}``), `closing` (also the closing ``}`` -- the character that decides where the answer
ends -- and the stop token right after it), `closing_line` (the whole line holding the last box,
from its start, and the stop token right after it), `closing_only` (the closing ``}`` and the
stop token right after it, without the box's content: study v4's generic mask)."""
