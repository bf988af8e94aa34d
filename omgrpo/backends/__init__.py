"""Training backends other than the native single-process trainer (`omgrpo.backends.native.trainer`).

- `omgrpo.backends.verl`: OM-GRPO as a plugin on an unforked, pinned verl (Ray, FSDP, vLLM);
  installed with the `omgrpo[verl]` extra. See docs/verl.md.
"""
