"""omgrpo: Outcome-Masked GRPO for label-free RLVR, with a CPU toy world for studying collapse."""

__version__ = "0.1.0"
