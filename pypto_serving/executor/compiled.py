"""Compile once, execute many: decoder layers under torch.compile, with a compile counter.

The model runs eagerly around one compiled `DecoderLayer.forward`. The layers differ only in
their tensors, which are graph inputs, so all of them share one graph per kind of layer
(dense or mixture of experts), with the token count dynamic. Layers with quantized linears get
a second graph for a decode of one token (every size static): their one-row kernel call is a
trace-time branch; under int4-w8a8 a third, as their linears also branch at
QUANTIZED_MAX_ROWS (a graph for 2 to 8 tokens, one for more). Tracing and compiling one
layer instead of the whole model, and as few graphs as that, is what keeps start-up short
(each graph is several g++ runs on a cold cache).

Going through dynamo costs ~0.17 ms a call (its guards, the compiled region's wrappers), 5 ms
a token over 30 layers. So the first call that compiles a graph also captures it: where each
of the graph's inputs comes from (the layer's hidden states, cos, sin, the token count, or a
tensor of the layer, found by identity), checked by calling it directly on the same inputs
and comparing with dynamo's result. Later calls with the same kind of layer and step build
the inputs from the layer's own tensors (checked once per layer against the captured ones'
shapes, strides and dtypes) and call the compiled graph directly, as vLLM does. Anything that
does not fit the capture (a graph break, a layer whose tensors differ) goes through dynamo.

The compiled function takes the layer as an argument, so engines of the same architecture in
one process share graphs (the second engine's calls go through dynamo: its cache hits compile
nothing to capture), and Inductor's caches live in the project's cache directory, so a
restart reuses the compiled code. Every compilation is counted; one after warm-up is a
recompilation, logged and exposed as a metric.
"""

from __future__ import annotations

import logging
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pypto_serving.models.llama import CausalLM, DecoderLayer
from pypto_serving.ops.attention import KVAttention
from pypto_serving.ops.linear import Linear

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


_captured: list[tuple[list[object], Callable[..., Sequence[torch.Tensor]]]] = []
"""(example inputs, compiled graph) of each compilation since the last layer call began."""


def _capturing_backend(
    gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
) -> Callable[..., object]:
    fn = COUNTER.backend(gm, example_inputs)
    _captured.append((list(example_inputs), fn))  # type: ignore[arg-type]
    return fn


_layer: Callable[..., torch.Tensor] | None = None


def _compiled_layer() -> Callable[..., torch.Tensor]:
    global _layer
    if _layer is None:
        torch._dynamo.config.cache_size_limit = 64  # several architectures in one process
        _layer = torch.compile(DecoderLayer.forward, backend=_capturing_backend)
    return _layer


_ISA_CHECK = """
#if defined(__x86_64__)
#include <immintrin.h>
#endif
int pypto_isa_check() { return 0; }
"""


def trust_cpu_vector_isa() -> bool:
    """Let Inductor use the widest SIMD ISA the CPU reports without its own probes.

    Inductor checks each ISA the CPU reports by compiling a test against torch's vector
    headers and loading it in a child Python: ~6 s of a cold start, and 1.2 s of every warm
    one (the loading is not cached). The CPU's flags already say what it runs; what is left to
    check is that the compiler takes the ISA's flags, which a few lines of intrinsics show in
    ~50 ms. Returns whether the ISA is trusted; where the quick check fails (or the user set
    TORCHINDUCTOR_VEC_ISA_OK), Inductor decides as it would have."""
    from torch._inductor import config, cpp_builder, cpu_vec_isa

    if config.cpp.vec_isa_ok is not None:
        return False
    config.cpp.vec_isa_ok = True
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    isa = cpu_vec_isa.pick_vec_isa()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            source = f"{tmp}/isa.cpp"
            with open(source, "w") as f:
                f.write(_ISA_CHECK)
            cmd = [cpp_builder.get_cpp_compiler(), *isa.build_arch_flags().split()]
            subprocess.run(
                [*cmd, "-c", source, "-o", f"{tmp}/isa.o"],
                capture_output=True,
                check=True,
                timeout=60,
            )
        return True
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.info("the compiler did not take %s's flags (%s); Inductor probes its ISA", isa, e)
        config.cpp.vec_isa_ok = None
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        return False


Where = tuple[str, str, str | int | None]
"""A layer tensor's place: (submodule name, attribute, parameter/buffer name or tuple index)."""


def _places(layer: nn.Module) -> dict[int, Where]:
    """id -> place of every tensor a layer holds: parameters, buffers, plain tensor
    attributes (packed or quantized weights, the attention layer's index), tuples of them."""
    places: dict[int, Where] = {}
    for name, m in layer.named_modules():
        for attr, value in vars(m).items():
            if isinstance(value, torch.Tensor):
                places[id(value)] = (name, attr, None)
            elif isinstance(value, tuple):
                for i, item in enumerate(value):
                    if isinstance(item, torch.Tensor):
                        places[id(item)] = (name, attr, i)
        for kind in ("_parameters", "_buffers"):
            for key, value in getattr(m, kind).items():
                if value is not None:
                    places[id(value)] = (name, kind, key)
    return places


def _fetch(layer: nn.Module, where: Where) -> object:
    name, attr, key = where
    m = layer.get_submodule(name)
    if attr in ("_parameters", "_buffers"):
        return getattr(m, attr)[key]
    value = vars(m).get(attr)
    return value if key is None or value is None else value[key]  # type: ignore[index]


def _same_meta(a: object, b: object) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)
    )


@dataclass
class LayerGraph:
    """One compiled graph of `DecoderLayer.forward`, called without dynamo."""

    fn: Callable[..., Sequence[torch.Tensor]]
    examples: list[object]
    plan: list[str | Where]
    """Per graph input: "x", "cos", "sin", "tokens" (the token count), or a layer tensor's place."""
    _bound: dict[int, list[object] | None] = field(default_factory=dict)

    @classmethod
    def capture(
        cls,
        fn: Callable[..., Sequence[torch.Tensor]],
        examples: list[object],
        layer: DecoderLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> LayerGraph | None:
        """The graph compiled while running `layer` on x, cos, sin; None where an input's
        origin cannot be told."""
        places, args = _places(layer), {"x": x, "cos": cos, "sin": sin}
        plan: list[str | Where] = []
        for e in examples:
            if isinstance(e, torch.SymInt | int) and not isinstance(e, bool):
                if int(e) != len(x):
                    return None
                plan.append("tokens")
                continue
            name = next((k for k, v in args.items() if v is e), None)
            if name is None and id(e) not in places:
                return None
            plan.append(name if name is not None else places[id(e)])
        return cls(fn, examples, plan)

    def _bind(self, layer: DecoderLayer) -> list[object] | None:
        """The layer's constant inputs (None in the slots a call fills), or None where its
        tensors do not match the captured ones."""
        inputs: list[object] = []
        for where, example in zip(self.plan, self.examples, strict=True):
            if isinstance(where, str):
                inputs.append(None)
                continue
            value = _fetch(layer, where)
            if not _same_meta(value, example):
                return None
            inputs.append(value)
        return inputs

    def __call__(
        self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        """The layer's output, or None where this graph does not fit the layer."""
        if id(layer) not in self._bound:
            self._bound[id(layer)] = self._bind(layer)
        bound = self._bound[id(layer)]
        if bound is None:
            return None
        step = {"x": x, "cos": cos, "sin": sin, "tokens": len(x)}
        args = [step[w] if isinstance(w, str) else b for w, b in zip(self.plan, bound, strict=True)]
        (out,) = self.fn(*args)
        return out


class CompiledLayers:
    """Runs decoder layers through the compiled graph they share (`forward_logits`'s
    `run_layer`) and, once captured, directly. One per model (the captured graphs hold its
    tensors)."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[type, type, int], LayerGraph] = {}
        """(kind of MLP, kind of KV attention, class of the step's token count) -> its
        captured graph."""
        self._row_bounds: dict[int, list[int]] = {}
        """id(layer) -> the token counts at which its code branches when traced (its
        linears' `row_bounds`): a step's class is how many of them its count exceeds."""

    def __call__(
        self,
        layer: DecoderLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVAttention,
    ) -> torch.Tensor:
        if (bounds := self._row_bounds.get(id(layer))) is None:
            bounds = sorted(
                {b for m in layer.modules() if isinstance(m, Linear) for b in m.row_bounds}
            )
            self._row_bounds[id(layer)] = bounds
        key = (type(layer.mlp), type(kv), sum(len(x) > b for b in bounds))
        graph = self.graphs.get(key)
        if graph is not None and (out := graph(layer, x, cos, sin)) is not None:
            return out
        for t in (x, cos, sin):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        _captured.clear()
        out = _compiled_layer()(layer, x, cos, sin, kv)
        # dynamo specialises a size of 1, so a graph compiled for one token is static: it
        # can only be the one-token graph, never the shared one (that happens when another
        # engine's graph of this architecture served the larger steps from dynamo's cache)
        static = len(x) == 1
        if graph is None and len(_captured) == 1 and static == (1 in bounds and key[2] == 0):
            examples, fn = _captured[0]
            graph = LayerGraph.capture(fn, examples, layer, x, cos, sin)
            if graph is not None and torch.equal(graph(layer, x, cos, sin), out):
                self.graphs[key] = graph
            else:
                log.info("a compiled layer graph could not be captured; it runs through dynamo")
        _captured.clear()
        return out
