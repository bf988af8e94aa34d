"""The algorithm, backend-agnostic: answers and grading, answer spans, rewards, CAR, group
advantages and the masked loss, one step's scoring (`StepBatch`) and its diagnostics.

Pure functions and small typed records; nothing here generates text, trains or logs."""
