"""The native single-process trainer (CPU or one GPU): the training loop, validation and
checkpoint / resume."""
