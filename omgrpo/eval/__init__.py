"""Evaluation on benchmark suites: `omgrpo eval` (docs/eval.md).

suite        what is evaluated and how (files, k, temperature, top-p, tokens, template)
data         benchmark loaders (MATH500, GSM8K `####`, AIME, AMC) and `omgrpo data convert`
checkpoints  which weights (last / best by a validation metric / step_N / base) and why
sampler      sampling backends: native, vLLM (optional)
metrics      avg@k, unbiased pass@k, maj@k, extraction rate, bootstrap CIs
runner       sample, grade, write parquet + summary.json, log to the run's trackers
"""
