"""Compile once, execute many: the model forward under torch.compile, with a compile counter.

Token counts are dynamic dimensions, so one graph serves every batch composition (dynamo
specialises sizes of 1, hence a decode-of-one graph beside the general one). The compiled
function takes the model as an argument, so engines of the same architecture in one process
share graphs, and Inductor's caches live in the project's cache directory, so a restart
reuses the compiled code. Every compilation is counted; one after warm-up is a
recompilation, logged and exposed as a metric.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pypto_serving.models.llama import CausalLM
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
) -> torch.Tensor:
    """Logits [N, vocab] of the tokens at logits_index after a forward over [T] tokens; on a
    pipeline stage before the last, its hidden states [T, hidden] (`hidden`: the previous
    stage's)."""
    hidden = model(input_ids, positions, kv, hidden)
    if not model.last_stage:
        return hidden
    return model.logits(hidden[logits_index])


_compiled: Callable[..., torch.Tensor] | None = None


def compiled_forward_logits(
    model: CausalLM,
    kv: KVAttention,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    logits_index: torch.Tensor,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """`forward_logits` under torch.compile, with the token dimensions dynamic."""
    global _compiled
    if _compiled is None:
        torch._dynamo.config.cache_size_limit = 64  # several architectures in one process
        _compiled = torch.compile(forward_logits, backend=COUNTER.backend)
    for t in (input_ids, positions, logits_index, hidden):
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    return _compiled(model, kv, input_ids, positions, logits_index, hidden)
