"""Test-only: an "hf" rollout backend for verl 0.9.1 (transformers `generate` on the CPU).

verl's rollouts are vLLM / SGLang / TensorRT-LLM servers (`verl/workers/rollout/base.py:89`
`_ROLLOUT_REGISTRY`, `verl/workers/rollout/replica.py:388` `RolloutReplicaRegistry`); this adds
"hf" to both registries. The sync trainer needs from a backend only: a server actor answering
`generate` with a `TokenOutput` (and the no-op memory calls: sleep / wake_up / clear_kv_cache),
a replica that launches it, and an adapter inside the FSDP worker that pushes the updated
weights to it after each step (checkpoint backend "naive", `engine_workers.py` update_weights).

It also makes FSDP2 build without pinned memory (the ref engine's
`CPUOffloadPolicy(pin_memory=True)`, `verl/workers/engine/fsdp/transformer_impl.py:462`, needs
an accelerator). Loaded through `VERL_USE_EXTERNAL_MODULES` after `omgrpo_cpu_platform`; kept
in its own module because a Ray worker unpickling the server class imports this module first:
its first verl import runs `verl/__init__.py`, which must register the cpu platform (the other
module) before anything here asks for it.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import ray
import torch
from transformers import AutoModelForCausalLM
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

NAME = "hf"


def server_name(replica_rank: int) -> str:
    return f"{NAME}_server_{replica_rank}"


class HFServer:
    """One rollout server: a CPU copy of the policy; requests run one at a time."""

    def __init__(self, model_path: str, response_length: int, max_model_len: int, seed: int):
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, torch_dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.response_length = response_length
        self.max_model_len = max_model_len
        self.global_steps: int | None = None
        self.lock = asyncio.Lock()
        self.requests = 0
        torch.set_num_threads(1)
        torch.manual_seed(seed)

    async def generate(
        self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str, **_: Any
    ) -> TokenOutput:
        params = dict(sampling_params)
        max_tokens = int(params.pop("max_tokens", self.response_length))
        max_tokens = max(1, min(max_tokens, self.max_model_len - len(prompt_ids)))
        temperature = float(params.get("temperature", 1.0))
        kwargs: dict[str, Any] = {"do_sample": temperature > 0}
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=float(params.get("top_p", 1.0)))
            top_k = int(params.get("top_k", -1))
            kwargs["top_k"] = top_k if top_k > 0 else None
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        async with self.lock:
            self.requests += 1
            with torch.no_grad():
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_tokens,
                    pad_token_id=self.model.config.pad_token_id,
                    eos_token_id=self.model.config.eos_token_id,
                    **kwargs,
                )
        tokens = out[0, ids.shape[1] :].tolist()
        if os.environ.get("OMGRPO_HF_SERVER_LOG"):  # what the test checks the trainer against
            record = {"request_id": request_id, "global_steps": self.global_steps}
            record.update(prompt_ids=list(prompt_ids), token_ids=tokens, max_tokens=max_tokens)
            with open(os.environ["OMGRPO_HF_SERVER_LOG"], "a") as f:
                f.write(json.dumps(record) + "\n")
        return TokenOutput(
            token_ids=tokens,
            stop_reason="completed",
            # verl's vLLM server returns the step of its weights; the trainer needs it.
            extra_fields={"global_steps": self.global_steps},
        )

    def load_weights(self, state: dict[str, torch.Tensor], global_steps: int | None) -> int:
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if self.model.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"hf server: weights do not match: {missing=} {unexpected=}")
        self.global_steps = global_steps
        return len(state)

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "global_steps": self.global_steps}

    def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # Memory management of a GPU server: nothing to do on the CPU.
    async def wake_up(self, tags: list[str] | None = None) -> None: ...
    async def sleep(self) -> None: ...
    async def clear_kv_cache(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def abort_all_requests(self, reject_request: bool = False) -> None: ...
    async def resume_generation(self) -> None: ...


class HFReplica(RolloutReplica):
    """Launches one `HFServer` per replica (hybrid mode: the FSDP workers hold the policy)."""

    async def launch_servers(self) -> None:
        cfg = self.config
        max_len = cfg.max_model_len or cfg.prompt_length + cfg.response_length
        server = (
            ray.remote(HFServer)
            .options(name=server_name(self.replica_rank), max_concurrency=self.max_concurrency)
            # model_config is the DictConfig here (no local_path): the test passes a local dir
            .remote(self.model_config.path, cfg.response_length, max_len, cfg.seed)
        )
        await server.stats.remote()  # wait until loaded
        self.servers = [server]
        self._server_handle = server
        self._server_address = server_name(self.replica_rank)


class HFServerAdapter(BaseRollout):
    """The rollout object inside each FSDP worker: sends the actor's weights to its server."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        self.rank = int(os.environ["RANK"])
        self.replica_rank = self.rank if replica_rank == -1 else replica_rank

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    async def update_weights(self, weights, global_steps: int | None = None, **kwargs: Any):
        state = {name: t.detach().to("cpu", torch.float32).clone() for name, t in weights}
        server = ray.get_actor(server_name(self.replica_rank))
        await server.load_weights.remote(state, global_steps)


rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.HFServerAdapter"
RolloutReplicaRegistry.register(NAME, lambda: HFReplica)


def _unpinned(policy_cls: type) -> Any:
    def make(*args: Any, **kwargs: Any) -> Any:
        return policy_cls(*args, **{**kwargs, "pin_memory": False})

    return make


# FSDP2 offload without pinned memory (pinning needs an accelerator).
transformer_impl.CPUOffloadPolicy = _unpinned(transformer_impl.CPUOffloadPolicy)
