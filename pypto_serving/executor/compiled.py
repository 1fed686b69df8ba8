"""Compile once, execute many: decoder layers under torch.compile, kept across restarts,
with a compile counter.

The model runs eagerly around one compiled decoder layer `forward` (its class's own). The
layers differ only in their tensors, which are graph inputs, so all of them share one graph
per kind of layer (what it is made of: dense or mixture of experts, ...), with the token
count dynamic; a layer may take more of the step than its hidden states and RoPE (`extra`:
DeepSeek-V4's token ids and positions). Layers with
quantized linears get a second graph for a decode of one token (every size static): their
one-row kernel call is a trace-time branch; under int4-w8a8 a third, as their linears also branch
at QUANTIZED_MAX_ROWS (a graph for 2 to 8 tokens, one for more). Tracing and compiling one
layer instead of the whole model, and as few graphs as that, is what keeps start-up short
(each graph is several g++ runs on a cold cache).

Going through dynamo costs ~0.17 ms a call (its guards, the compiled region's wrappers), 5 ms
a token over 30 layers, so layers call their graph directly, as vLLM does. A graph is
compiled ahead of time (dynamo's `aot_compile`, whole graph) and captured: where each of its
inputs comes from (the layer's hidden states, cos, sin, the token count, or a tensor of the
layer, found by identity), checked by calling it directly and comparing with the compiled
function's own result. Later calls build the inputs from each layer's own tensors (checked
once per layer against the captured ones' shapes, strides and dtypes).

The compiled graph and its capture are kept in `cache_dir()/graphs`, keyed by what the graph
is made of (`graph_path`), so a restart, or a second engine in the process, loads them
(~0.03 s a graph once Inductor is imported) instead of tracing and looking up Inductor's
caches (~1 s a graph). Loading one runs code (it is unpickled), so a file is only read from a
folder no other user can write (`trusted_cache_dir`), and unpickled only once its keyed digest
(by the cache folder's secret, written on save) checks. A loaded graph is checked with its
guards and against its own compiled function's result. Anything that cannot take this path (a
graph break, a graph whose inputs cannot be told) goes through dynamo, and is captured there
where it can be. Every compilation is counted; one after warm-up is a recompilation, logged
and exposed as a metric. Warm-up may compile in a background thread
(`CompiledLayers.compiler`) while other threads serve: they run a layer whose graph is not
there yet eagerly, and never compile.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import io
import logging
import pickle
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from pypto_serving.device import cpu_isa
from pypto_serving.models.config import ModelConfig
from pypto_serving.models.llama import CausalLM, DecoderLayer
from pypto_serving.ops.attention import KVAttention
from pypto_serving.ops.linear import Linear
from pypto_serving.paths import (
    DIGEST_BYTES,
    UntrustedPathError,
    cache_dir,
    keyed_digest,
    secret_key,
    trusted_cache_dir,
    write_atomically,
)

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
        return cast(Callable[..., object], compile_fx(gm, example_inputs))


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
    pipeline stage before the last, what it sends on (`stage_output_shape`: its hidden states,
    or DeepSeek-V4's residual streams; `hidden`: the previous stage's). run_layer: how each
    decoder layer runs (None: eagerly)."""
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


_layers: dict[type[DecoderLayer], Callable[..., torch.Tensor]] = {}
"""The decoder layer classes' `forward` under torch.compile, each its own (a model's layer
class may override it: Gemma 3's four norms)."""


def _compiled_layer(cls: type[DecoderLayer]) -> Callable[..., torch.Tensor]:
    if cls not in _layers:
        torch._dynamo.config.cache_size_limit = 64  # several architectures in one process
        _layers[cls] = torch.compile(cls.forward, backend=_capturing_backend)
    return _layers[cls]


_ISA_CHECK = """
#if defined(__x86_64__)
#include <immintrin.h>
#endif
int pypto_isa_check() { return 0; }
"""


_isa_lock = threading.Lock()


def trust_cpu_vector_isa_soon() -> None:
    """Start `trust_cpu_vector_isa` in a background thread: its compiler run and Inductor's
    own load probes (~0.7 s of a start, spent waiting on child processes) then overlap the
    model's loading. Warm-up's own call waits for it."""
    threading.Thread(target=trust_cpu_vector_isa, name="pypto-isa", daemon=True).start()


def trust_cpu_vector_isa() -> bool:
    """Let Inductor use the widest SIMD ISA the CPU reports without its own probes, at most
    `device.cpu_isa()`'s width (256 bits under AVX2, PYPTO_CPU_ISA included).

    Inductor checks each ISA the CPU reports by compiling a test against torch's vector
    headers and loading it in a child Python: ~6 s of a cold start, and 1.2 s of every warm
    one (the loading is not cached). The CPU's flags already say what it runs; what is left to
    check is that the compiler takes the ISA's flags, which a few lines of intrinsics show in
    ~50 ms. Returns whether the ISA is trusted; where the quick check fails (or the user set
    TORCHINDUCTOR_VEC_ISA_OK), Inductor decides as it would have. Inductor's config is per
    thread (torch keeps it in context variables): each thread that compiles calls this; if it
    raises, the config is left as it was."""
    with _isa_lock:
        return _trust_cpu_vector_isa()


def _trust_cpu_vector_isa() -> bool:
    from torch._inductor import config, cpu_vec_isa

    if cpu_isa() == "avx2" and config.cpp.simdlen is None:
        config.cpp.simdlen = 256  # Inductor's own pick sees the CPU, not device.py's cap
    if config.cpp.vec_isa_ok is not None:
        return False
    trusted = False
    config.cpp.vec_isa_ok = True
    try:
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        trusted = _compiler_takes(cpu_vec_isa.pick_vec_isa())
        return trusted
    finally:
        if not trusted:  # a no, or an exception passing: leave Inductor as it was
            config.cpp.vec_isa_ok = None
            cpu_vec_isa.valid_vec_isa_list.cache_clear()


_taken: set[tuple[str, ...]] = set()
"""The compiler commands (compiler and ISA flags) that compiled `_ISA_CHECK` in this process:
the next engine's start skips the compiler run (~0.7 s)."""


def _compiler_takes(isa: Any) -> bool:
    """Whether Inductor's C++ compiler compiles `_ISA_CHECK` with `isa`'s flags (any failure
    is a no, logged: Inductor then probes as it would have)."""
    from torch._inductor import cpp_builder

    try:
        cmd = (cpp_builder.get_cpp_compiler(), *isa.build_arch_flags().split())
        if cmd in _taken:
            return True
        with tempfile.TemporaryDirectory() as tmp:
            source = f"{tmp}/isa.cpp"
            with open(source, "w") as f:
                f.write(_ISA_CHECK)
            subprocess.run(
                [*cmd, "-c", source, "-o", f"{tmp}/isa.o"],
                capture_output=True,
                check=True,
                timeout=60,
            )
        _taken.add(cmd)
        return True
    except Exception as e:
        log.info("the compiler did not take %s's flags (%s); Inductor probes its ISA", isa, e)
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
    return value if key is None or value is None else value[key]


Meta = tuple[tuple[int, ...], tuple[int, ...], str, str]
"""A tensor's shape, strides, dtype and device type: what a graph input must match."""


def _meta(t: object) -> Meta | None:
    if not isinstance(t, torch.Tensor):
        return None
    return tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type


def _step_inputs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, extra: tuple[torch.Tensor, ...]
) -> dict[str, torch.Tensor]:
    """A step's tensors a layer takes, by their names in a graph's plan."""
    return {"x": x, "cos": cos, "sin": sin} | {f"extra{i}": t for i, t in enumerate(extra)}


@dataclass
class LayerGraph:
    """One compiled graph of `DecoderLayer.forward`, called without dynamo."""

    fn: Callable[..., Sequence[torch.Tensor]]
    plan: list[str | Where]
    """Per graph input: "x", "cos", "sin", "extra0", "extra1", ... (the step's other tensors a
    layer takes, `CompiledLayers`' `extra`), "tokens" (the token count), or a layer tensor's
    place."""
    metas: list[Meta | None]
    """Per graph input: what the layer's tensor there must be like (None for the step's)."""
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
        extra: tuple[torch.Tensor, ...] = (),
    ) -> LayerGraph | None:
        """The graph compiled while running `layer` on x, cos, sin (and `extra`); None where
        an input's origin cannot be told."""
        places, args = _places(layer), _step_inputs(x, cos, sin, extra)
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
        metas = [
            None if isinstance(w, str) else _meta(e) for w, e in zip(plan, examples, strict=True)
        ]
        return cls(fn, plan, metas)

    def _bind(self, layer: DecoderLayer) -> list[object] | None:
        """The layer's constant inputs (None in the slots a call fills), or None where its
        tensors do not match the captured ones."""
        inputs: list[object] = []
        for where, meta in zip(self.plan, self.metas, strict=True):
            if isinstance(where, str):
                inputs.append(None)
                continue
            try:
                value = _fetch(layer, where)
            except (AttributeError, KeyError, IndexError, TypeError):  # a layer of another kind
                return None
            if meta is None or _meta(value) != meta:
                return None
            inputs.append(value)
        return inputs

    def __call__(
        self,
        layer: DecoderLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        extra: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor | None:
        """The layer's output, or None where this graph does not fit the layer."""
        if id(layer) not in self._bound:
            self._bound[id(layer)] = self._bind(layer)
        bound = self._bound[id(layer)]
        if bound is None:
            return None
        step: dict[str, object] = {**_step_inputs(x, cos, sin, extra), "tokens": len(x)}
        args = [step[w] if isinstance(w, str) else b for w, b in zip(self.plan, bound, strict=True)]
        (out,) = self.fn(*args)
        return out


GRAPH_FORMAT = 2
"""Bumped when what a kept graph file holds changes meaning."""
GRAPH_MAGIC = b"PYPTOGR2"
"""A kept graph file: GRAPH_MAGIC | keyed digest of the rest | pickle."""


@functools.cache
def _code_digest() -> str:
    """The package's source: a traced graph is its code's, so kept graphs are keyed by it."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def graph_path(
    layer: DecoderLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: object,
    cls: int,
    extra: tuple[torch.Tensor, ...] = (),
) -> Path | None:
    """Where the graph for steps of class `cls` of layers like this one is kept across
    restarts: keyed by everything the graph is made of (the code, the layer's configuration
    and tensors, the inputs' dtypes, torch, the CPU's ISA, the thread count Inductor's loops
    are written for). None where graphs are not kept: the ranks of a parallel group, whose
    graphs hold its collectives, and a cache folder another user could write into."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return None
    folder = trusted_cache_dir("graphs")
    if folder is None:
        return None
    tensors = sorted((repr(w), _meta(_fetch(layer, w))) for w in _places(layer).values())
    parts = [
        GRAPH_FORMAT,
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        cpu_isa(),
        torch.get_num_threads(),
        _code_digest(),
        type(layer).__qualname__,
        _structure(layer),
        type(kv).__qualname__,
        cls,
        len(x) == 1,
        repr(_config(layer)),
        [(t.dtype, t.shape[1:], t.device.type) for t in (x, cos, sin, *extra)],
        tensors,
    ]
    key = hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()
    return folder / f"{key}.bin"


def _structure(layer: nn.Module) -> tuple[tuple[str, str], ...]:
    """What a layer is made of: each submodule's name and class (a dense or a mixture-of-
    experts MLP, a compressed or a windowed attention, ...); layers alike share a graph."""
    return tuple((name, type(m).__qualname__) for name, m in layer.named_modules())


def _config(layer: nn.Module) -> object:
    """The model configuration a layer's modules were built from (their shapes, norms' eps,
    windows: constants of its graph)."""
    return next(
        (m.cfg for m in layer.modules() if isinstance(getattr(m, "cfg", None), ModelConfig)), None
    )


def _read_kept(path: Path) -> Any:
    """The object kept at `path`, unpickled only after its digest is checked with the cache
    folder's secret; ValueError where it was not written by `_keep` (planted, damaged), and
    UntrustedPathError where the folder could hold another user's files."""
    if trusted_cache_dir(path.parent.name) != path.parent:
        raise UntrustedPathError(f"{path.parent} is not a private cache folder")
    data = path.read_bytes()
    start = len(GRAPH_MAGIC) + DIGEST_BYTES
    digest, body = data[len(GRAPH_MAGIC) : start], data[start:]
    want = keyed_digest(secret_key(cache_dir()), body)
    if data[: len(GRAPH_MAGIC)] != GRAPH_MAGIC or not hmac.compare_digest(digest, want):
        raise ValueError("not written by this cache (its keyed digest does not check)")
    return pickle.loads(body)


def _keep(path: Path, obj: object) -> None:
    """Keep `obj` pickled at `path`, behind the keyed digest `_read_kept` checks."""
    body = pickle.dumps(obj)
    write_atomically(path, GRAPH_MAGIC + keyed_digest(secret_key(cache_dir()), body) + body)


def _load_graph(
    path: Path,
    layer: DecoderLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: object,
    extra: tuple[torch.Tensor, ...] = (),
) -> tuple[LayerGraph, torch.Tensor] | None:
    """A kept graph and its output for this step, or None where it cannot be used (it is then
    compiled again, and the file replaced)."""
    try:
        saved = _read_kept(path)
        aot: Any = torch.compiler.load_compiled_function(io.BytesIO(saved["artifact"]))
        # its guards check tensors as dynamo saw them when compiling: not marked dynamic
        views = [t.view_as(t) for t in (x, cos, sin, *extra)]
        args = (layer, *views[:3], kv, *views[3:])
        if not aot.guard_check(*args):
            log.info("the kept layer graph %s does not fit this layer: compiling it", path)
            return None
        # the graph Inductor compiled (what the dynamo-made code around it calls)
        graph = LayerGraph(aot._artifacts.compiled_fn, saved["plan"], saved["metas"])
        out, direct = aot(*args), graph(layer, x, cos, sin, extra)
    except Exception as e:  # a damaged or stale file of a cache: compile instead
        log.info("the kept layer graph %s cannot be loaded (%s): compiling it", path, e)
        return None
    return (graph, out) if _same(direct, out) else None


def _same(direct: torch.Tensor | None, out: torch.Tensor) -> bool:
    """Whether a captured graph's direct call gave the compiled function's result."""
    return direct is not None and torch.equal(direct, out)


def _keep_graph(path: Path, aot: Any, graph: LayerGraph) -> None:
    """Write a compiled graph where `graph_path` says (atomically: replicas starting at once
    never read half a file). Best effort: a graph not kept is compiled at the next start."""
    try:
        artifact = type(aot).serialize(aot).serialized_data
        _keep(path, {"artifact": artifact, "plan": graph.plan, "metas": graph.metas})
    except Exception as e:  # serialization refusing a graph, a full disk: serve on
        log.info("a compiled layer graph cannot be kept in %s (%s)", path, e)


_aot: dict[type[DecoderLayer], Any] = {}
"""The decoder layer classes' `forward` for `aot_compile`, each its own."""


def _kept_guards(entries: Sequence[Any]) -> list[bool]:
    """The guards a kept graph checks: dynamo's choice for saved graphs (no globals, none
    that cannot be serialized), less those on oneDNN-packed weights, which cannot be (the
    graph's own check of each layer's tensors covers them)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [
        not (
            e.is_global
            or e.guard_type in unsupported
            or (e.has_value and isinstance(e.value, torch.Tensor) and e.value.is_mkldnn)
        )
        for e in entries
    ]


def _compile_graph(
    layer: DecoderLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: object,
    path: Path | None,
    extra: tuple[torch.Tensor, ...] = (),
) -> tuple[LayerGraph, torch.Tensor] | None:
    """Compile the layer's graph for this step ahead of time (dynamo's `aot_compile`, whole
    graph), capture it, keep it at `path`; None where that cannot be done (a graph break,
    Inductor's caches disabled, an input whose origin cannot be told)."""
    from torch._dynamo.exc import BackendCompilerFailed, Unsupported
    from torch._inductor.exc import InductorError

    cls = type(layer)
    if cls not in _aot:
        options: dict[str, Any] = {"guard_filter_fn": _kept_guards}
        _aot[cls] = torch.compile(
            cls.forward, fullgraph=True, backend=_capturing_backend, options=options
        )
    _captured.clear()
    try:
        aot = _aot[cls].aot_compile(((layer, x, cos, sin, kv, *extra), {}))
    except (BackendCompilerFailed, InductorError):
        raise  # no compiler: the executor serves eagerly
    except (Unsupported, RuntimeError) as e:
        log.info("a layer graph cannot be compiled ahead of time (%s): dynamo runs it", e)
        return None
    finally:
        captured, _captured[:] = list(_captured), []
    out = aot(layer, x, cos, sin, kv, *extra)
    if len(captured) != 1:  # a whole graph is one backend call; anything else is not ours
        return None
    graph = LayerGraph.capture(captured[0][1], captured[0][0], layer, x, cos, sin, extra)
    if graph is None or not _same(graph(layer, x, cos, sin, extra), out):
        log.info("a compiled layer graph could not be captured; it runs through dynamo")
        return None
    if path is not None:
        _keep_graph(path, aot, graph)
    return graph, out


class CompiledLayers:
    """Runs decoder layers through the compiled graphs they share (`forward_logits`'s
    `run_layer`), called directly: each is loaded from the cache directory, or compiled ahead
    of time and kept there, the first time a step needs it. One per model (the captured
    graphs hold its tensors)."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[type, tuple[tuple[str, str], ...], type, int], LayerGraph] = {}
        """(class of layer, what it is made of (`_structure`), kind of KV attention, class of
        the step's token count) -> its captured graph."""
        self._structures: dict[int, tuple[tuple[str, str], ...]] = {}
        """id(layer) -> `_structure(layer)`."""
        self._row_bounds: dict[int, list[int]] = {}
        """id(layer) -> the token counts at which its code branches when traced (its
        linears' `row_bounds`): a step's class is how many of them its count exceeds."""
        self._through_dynamo: set[tuple[type, tuple[tuple[str, str], ...], type, int]] = set()
        """Classes whose graph could not be compiled ahead of time or captured."""
        self.compiler: threading.Thread | None = None
        """While warm-up compiles in a background thread (this one): the other threads run a
        layer whose graph is not there yet eagerly, and never compile."""

    def __call__(
        self,
        layer: DecoderLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVAttention,
        *extra: torch.Tensor,
    ) -> torch.Tensor:
        """Layer `layer` on the step's hidden states x, cos and sin (and the `extra` tensors
        its forward takes after kv: DeepSeek-V4's token ids and positions), through its
        graph."""
        if (bounds := self._row_bounds.get(id(layer))) is None:
            bounds = sorted(
                {b for m in layer.modules() if isinstance(m, Linear) for b in m.row_bounds}
            )
            self._row_bounds[id(layer)] = bounds
            self._structures[id(layer)] = _structure(layer)
        structure = self._structures[id(layer)]
        key = (type(layer), structure, type(kv), sum(len(x) > b for b in bounds))
        graph = self.graphs.get(key)
        if graph is not None and (out := graph(layer, x, cos, sin, extra)) is not None:
            return out
        if (compiler := self.compiler) is not None and compiler is not threading.current_thread():
            return layer(x, cos, sin, kv, *extra)  # until the background warm-up made its graph
        for t in (x, cos, sin, *extra):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        # dynamo specialises a size of 1, so a graph made for one token is static: it can
        # only be the one-token graph of quantized layers, never the one for every count
        fits = (len(x) == 1) == (1 in bounds and key[3] == 0)
        if graph is None and fits and key not in self._through_dynamo:
            path = graph_path(layer, x, cos, sin, kv, key[3], extra)
            made = (
                None
                if path is None or not path.is_file()
                else _load_graph(path, layer, x, cos, sin, kv, extra)
            )
            made = made or _compile_graph(layer, x, cos, sin, kv, path, extra)
            if made is not None:
                self.graphs[key], out = made
                return out
            self._through_dynamo.add(key)
        _captured.clear()
        out = _compiled_layer(type(layer))(layer, x, cos, sin, kv, *extra)
        if graph is None and fits and len(_captured) == 1:
            examples, fn = _captured[0]
            graph = LayerGraph.capture(fn, examples, layer, x, cos, sin, extra)
            if graph is not None and _same(graph(layer, x, cos, sin, extra), out):
                self.graphs[key] = graph
            else:
                log.info("a compiled layer graph could not be captured; it runs through dynamo")
        _captured.clear()
        return out
