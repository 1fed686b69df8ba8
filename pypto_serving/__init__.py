"""PyPTO Serving: a minimal, readable, fast LLM inference server."""

from pypto_serving.paths import use_compile_cache

use_compile_cache()  # before torch is imported, so Inductor's cache lands in ours

from pypto_serving.engine.llm import LLM  # noqa: E402
from pypto_serving.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pypto_serving.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
