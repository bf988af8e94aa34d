"""Test-only: a "cpu" platform for verl 0.9.1, so verl's trainer runs on a machine without GPU.

Loaded in every verl process through `VERL_USE_EXTERNAL_MODULES` (first in the list), with
`VERL_PLATFORM=cpu`. verl knows only the nvidia / huawei / amd platforms and falls back to nvidia
without a GPU (`verl/plugin/platform/platform_manager.py:114`); `auto_set_device`
(`verl/utils/device.py:158`) keeps `trainer.device=cpu` only when the platform's device is
"cpu". This module must not import verl's workers: it runs inside `verl/__init__.py`, before
anything asks for the platform (docs/verl.md, "The CPU harness").
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.distributed
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


class _CpuDeviceModule(ModuleType):
    """`get_torch_device()` on the cpu platform: `torch.cpu` where it has the function, a no-op
    returning 0 otherwise (verl calls `max_memory_allocated`, `empty_cache`, `set_device`, ... on
    it, e.g. `verl/workers/engine_workers.py:219`), and the few whose result is used."""

    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)

    @staticmethod
    def mem_get_info(*args: Any) -> tuple[int, int]:
        return 0, 0  # (free, total)

    @staticmethod
    def get_device_name(*args: Any) -> str:
        return "CPU"  # verl's flops counter looks the name up (unknown: inf FLOP/s)

    def __getattr__(self, name: str) -> Any:
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: 0


_DEVICE_MODULE = _CpuDeviceModule("omgrpo_cpu_device")


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """CPU: device "cpu", gloo, Ray's logical "GPU" resource (`ray.init(num_gpus=...)`)."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:
        # verl moves tensors with `.to(get_device_id())`; 0 would mean cuda:0.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        # The resource pool asks Ray for "GPU" bundles (single_controller/ray/base.py:210);
        # the test starts Ray with logical GPUs.
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _gloo_only(init_process_group):
    """verl asks for "cpu:gloo,<device>:<backend>" (`verl/utils/distributed.py:89`), which is
    "cpu:gloo,cpu:gloo" here and rejected by torch (duplicate device type): use plain gloo."""

    def init(*args: Any, backend: str | None = None, **kwargs: Any) -> Any:
        if backend and "gloo" in backend:
            backend = "gloo"
        return init_process_group(*args, backend=backend, **kwargs)

    return init


if not getattr(torch.distributed.init_process_group, "_omgrpo_gloo", False):
    torch.distributed.init_process_group = _gloo_only(torch.distributed.init_process_group)
    torch.distributed.init_process_group._omgrpo_gloo = True

# FSDP engines are registered for cuda / npu only (`verl/workers/engine/base.py:405`).
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
