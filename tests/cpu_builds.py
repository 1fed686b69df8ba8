"""Which forced builds are this CPU's own: a test that runs a forced ISA build beside the
native one skips the forced one where the two are the same code."""

from __future__ import annotations

import os

import torch

from pypto_serving.device import cpu_march

AVX2_IS_THIS_BUILD = (
    cpu_march() == ("-march=x86-64-v3",)
    and torch.backends.cpu.get_cpu_capability() == "AVX2"
    and "PYPTO_CPU_ISA" not in os.environ
)
"""An AVX2 CPU without AVX-VNNI (AMD Zen 3): its own build is the AVX2 build (the same native
kernels, torch on the same code), which the native tests run."""

AVX2_ENV = {"PYPTO_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""A child process's environment for the AVX2 build: set before torch loads, torch's own
kernels run their AVX2 code too."""
