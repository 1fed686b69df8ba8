"""Compile once, execute many: the model forward under torch.compile, with a compile counter.

Two compiled paths, chosen per step by its token count:
- a decode of one token (single-stream decoding, where per-call overhead is what counts):
  the whole model as one graph, every size static;
- every other step (prefills, batched decodes, mixed): the model runs eagerly around one
  compiled `DecoderLayer.forward`, with the token count dynamic. The layers differ only in
  their tensors, which are graph inputs, so all of them share its graph: tracing and
  compiling one layer instead of the whole model keeps start-up short, and on a batch the
  ~0.2 ms each layer call costs (dynamo's guards, the compiled region's wrappers) is lost in
  the matmuls.

The compiled functions take the model as an argument, so engines of the same architecture in
one process share graphs, and Inductor's caches live in the project's cache directory, so a
restart reuses the compiled code. Every compilation is counted; one after warm-up is a
recompilation, logged and exposed as a metric.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pypto_serving.models.llama import CausalLM, DecoderLayer
from pypto_serving.ops.attention import KVAttention

log = logging.getLogger(__name__)


class CompileCounter:
    """Counts compilations (process-wide); those after `mark_warm` are recompilations."""

    def __init__(self) -> None:
        self.num_compiles = 0
        self._at_warmup: int | None = None

    @property
    def num_recompilations(self) -> int:
        return 0 if self._at_warmup is None else self.num_compiles - self._at_warmup

    def mark_warm(self) -> None:
        self._at_warmup = self.num_compiles

    def backend(
        self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
    ) -> Callable[..., object]:
        from torch._inductor.compile_fx import compile_fx

        self.num_compiles += 1
        if self._at_warmup is not None:
            log.warning("recompilation #%d while serving", self.num_recompilations)
        return compile_fx(gm, example_inputs)


COUNTER = CompileCounter()


def forward_logits(
    model: CausalLM,
    kv: KVAttention,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    logits_index: torch.Tensor,
    hidden: torch.Tensor | None = None,
    run_layer: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logits [N, vocab] of the tokens at logits_index after a forward over [T] tokens; on a
    pipeline stage before the last, its hidden states [T, hidden] (`hidden`: the previous
    stage's). run_layer: how each decoder layer runs (None: eagerly)."""
    hidden = model(input_ids, positions, kv, hidden, run_layer)
    if not model.last_stage:
        return hidden
    return model.logits(hidden[logits_index])


_whole_model: Callable[..., torch.Tensor] | None = None
_layer: Callable[..., torch.Tensor] | None = None


def compiled_layer(
    layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention
) -> torch.Tensor:
    """One decoder layer through the shared compiled graph, the token count dynamic."""
    for t in (x, cos, sin):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    assert _layer is not None
    return _layer(layer, x, cos, sin, kv)


def compiled_forward_logits(
    model: CausalLM,
    kv: KVAttention,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    logits_index: torch.Tensor,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """`forward_logits` compiled: the whole model for a decode of one token, compiled layers
    for any other step."""
    global _whole_model, _layer
    if _whole_model is None or _layer is None:
        torch._dynamo.config.cache_size_limit = 64  # several architectures in one process
        _whole_model = torch.compile(forward_logits, backend=COUNTER.backend)
        _layer = torch.compile(DecoderLayer.forward, backend=COUNTER.backend)
    if len(input_ids) == 1:
        return _whole_model(model, kv, input_ids, positions, logits_index, hidden)
    return forward_logits(model, kv, input_ids, positions, logits_index, hidden, compiled_layer)
