"""The run plan: the choices an engine's start-up makes once, from its config and the machine.

Device, dtype, threads, which kernels run (native attention, the native decode step, oneDNN
packing) and the quantization are resolved here, once per process, into a frozen `RunPlan`
that every rank builds from (rank 0 in `EngineCore`, the others in `engine/ranks.py`). The
code below takes the plan's answers as arguments: nothing asks the environment or
`device.py`'s capability checks again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pypto_serving.config import EngineConfig
from pypto_serving.device import (
    default_num_threads,
    resolve_device,
    resolve_dtype,
    use_native_attention,
    use_native_decode,
    use_packed_linear,
)
from pypto_serving.distributed import ParallelGroups
from pypto_serving.executor import native_decode
from pypto_serving.models.config import ModelConfig


@dataclass(slots=True, frozen=True)
class RunPlan:
    """What one rank of an engine runs with."""

    device: torch.device
    dtype: torch.dtype
    num_threads: int
    """CPU threads of PyTorch's (and the native kernels') thread team."""
    native_attention: bool
    """Paged attention on the native CPU kernels (else PyTorch's)."""
    native_decode: bool
    """Decode steps of a few sequences as one native call, where the model allows it
    (`decodes_natively` says for a model)."""
    pack_linear: bool
    """bf16 linear weights repacked for oneDNN."""
    quantization: str | None
    """The linear layers' quantization (config.py's names), or None."""

    def decodes_natively(self, cfg: ModelConfig, groups: ParallelGroups, page_size: int) -> bool:
        """Whether this model (this rank's share of it) runs its few-decode steps natively."""
        return self.native_decode and native_decode.applies(
            cfg, self.quantization, self.device, self.dtype, groups, page_size
        )


def plan_run(config: EngineConfig) -> RunPlan:
    """The plan of a rank whose config (device, num_threads) is its own (`plan_ranks`): the
    config's switches where the machine allows them."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    attention = config.native_attention and use_native_attention(device)
    return RunPlan(
        device=device,
        dtype=dtype,
        num_threads=config.num_threads or default_num_threads(),
        native_attention=attention,
        native_decode=attention and config.native_decode and use_native_decode(device),
        pack_linear=config.pack_linear and use_packed_linear(device, dtype),
        quantization=config.quantization,
    )
