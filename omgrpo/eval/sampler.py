"""Sampling backends for evaluation: k response texts per question, same format for both.

- `native`: `omgrpo.generation.rollout.sample` (KV cache, CPU or one GPU), the trainer's sampler.
- `vllm`: vLLM's offline `LLM.generate` (optional: `pip install -e '.[vllm]'`); a GPU user
  evaluates at vLLM speed. A run's checkpoint is exported to a temporary Hugging Face directory
  first (`omgrpo export`'s code, on the CPU); vLLM then loads the weights itself.

Both render the prompt with `omgrpo.tasks.PromptEncoder` (system prompt + question through the
model's chat template) and stop at the same tokens (`rollout.stop_token_ids`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from omgrpo.core.task import Problem
from omgrpo.eval.suite import BenchmarkSpec
from omgrpo.generation.rollout import sample, stop_token_ids
from omgrpo.tasks import PromptEncoder

BACKENDS = ("native", "vllm")
MAX_PROMPT_TOKENS = 1 << 20  # evaluation does not truncate prompts


class Sampler(Protocol):
    name: str

    def generate(self, problems: list[Problem], spec: BenchmarkSpec) -> list[list[str]]:
        """`spec.k` response texts per problem, in order."""


class NativeSampler:
    name = "native"

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 256):
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        self.stop_ids = stop_token_ids(tokenizer, model)

    @torch.no_grad()
    def generate(self, problems: list[Problem], spec: BenchmarkSpec) -> list[list[str]]:
        encode = PromptEncoder(self.tokenizer, MAX_PROMPT_TOKENS, spec.system_prompt)
        seqs = sample(
            self.model,
            [encode(p) for p in problems],
            n=spec.k,
            max_new_tokens=spec.max_new_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            eos_id=self.stop_ids,
            pad_id=self.tokenizer.pad_token_id,
            batch_size=self.batch_size,  # and what fits the free memory (generation.budget)
            seed=spec.seed,
        )
        lengths = seqs.response_mask.sum(-1).tolist()
        texts = [
            self.tokenizer.decode(row[:n].tolist(), skip_special_tokens=True)
            for row, n in zip(seqs.response_ids, lengths)
        ]
        return [texts[i * spec.k : (i + 1) * spec.k] for i in range(len(problems))]


def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        from omgrpo.errors import MissingDependency

        raise MissingDependency(
            "--backend vllm needs vLLM: `pip install -e '.[vllm]'` (a build matching your "
            "CUDA); or use --backend native"
        ) from e


class VLLMSampler:
    """vLLM's offline engine built from a HF directory; `llm_kwargs` go to `vllm.LLM`
    (tensor_parallel_size, gpu_memory_utilization)."""

    name = "vllm"

    def __init__(self, model_dir: str, tokenizer, dtype: str = "auto", **llm_kwargs):
        require_vllm()
        from vllm import LLM

        self.tokenizer = tokenizer
        self.llm = LLM(model=model_dir, dtype=dtype, **llm_kwargs)
        self.stop_ids = stop_token_ids(tokenizer, None)  # vLLM adds the model's own eos

    def generate(self, problems: list[Problem], spec: BenchmarkSpec) -> list[list[str]]:
        from vllm import SamplingParams

        encode = PromptEncoder(self.tokenizer, MAX_PROMPT_TOKENS, spec.system_prompt)
        params = SamplingParams(
            n=spec.k,
            temperature=spec.temperature,
            top_p=spec.top_p,
            max_tokens=spec.max_new_tokens,
            seed=spec.seed,
            stop_token_ids=self.stop_ids,
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": encode(p)} for p in problems], params, use_tqdm=False
        )
        return [[o.text for o in out.outputs] for out in outputs]
