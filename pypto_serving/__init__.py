"""PyPTO Serving: a minimal, readable, fast LLM inference server."""

from pypto_serving.engine.llm import LLM
from pypto_serving.outputs import CompletionOutput, RequestOutput
from pypto_serving.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
