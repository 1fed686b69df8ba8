"""PyPTO Serving: a minimal, readable, fast LLM inference server."""

import os
import sys

from pypto_serving.openmp import use_short_spin
from pypto_serving.paths import use_compile_cache

use_compile_cache()  # before torch is imported, so Inductor's cache lands in ours
use_short_spin()  # before torch loads libgomp, which reads it once (see openmp.py)

_TORCH_ISA_ENV = {"avx2": ("avx2", "AVX2"), "default": ("default", "SSE41")}
if "torch" not in sys.modules and os.environ.get("PYPTO_CPU_ISA", "").lower() in _TORCH_ISA_ENV:
    # device.py's ISA cap for torch's own kernels too, which read these once, as torch loads
    aten, onednn = _TORCH_ISA_ENV[os.environ["PYPTO_CPU_ISA"].lower()]
    os.environ.setdefault("ATEN_CPU_CAPABILITY", aten)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)

from pypto_serving.beam_search import BeamSearchParams  # noqa: E402
from pypto_serving.engine.llm import LLM  # noqa: E402
from pypto_serving.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pypto_serving.pooling import PoolingParams  # noqa: E402
from pypto_serving.sampling import SamplingParams  # noqa: E402

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
