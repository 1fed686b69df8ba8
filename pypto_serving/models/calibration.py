"""Smoothing factors for int8 activations (SmoothQuant), calibrated on a short built-in text.

Quantizing a linear layer's input to int8 per token loses the small channels of a token that
has a few very large ones, and in LLMs those large channels are the same ones token after
token. SmoothQuant (Xiao et al., 2023) divides each input channel j by
s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha) and multiplies the weight's column j by it: the
product is unchanged, and the channel maxima of activations and weights meet halfway, so
both quantize well. The maxima of the activations come from running the model (in its own
dtype, eagerly) over `calibration.txt`: about a thousand tokens of prose, code, a chat, a
list, other languages and numbers, written for this project.

On SmolLM2-135M, per-token int8 activations raise the perplexity over bf16 by ~4 %; with these
factors by ~1 % (docs/performance.md).

Where the CPU's int8 GEMM sums pairs of products in int16 (AVX2), a layer gives 7 bits either
to its inputs or to its weights: the same text, run again, shows which costs each layer less
(`choose_w8a8_inputs`); the LM head and the layers that make attention's queries and keys keep
8 bits both, in two GEMMs (`Linear.exact_int8`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from pypto_serving.device import release_freed_memory
from pypto_serving.models.llama import CausalLM, DecoderLayer
from pypto_serving.ops.attention import DenseKV
from pypto_serving.ops.linear import (
    Int8Form,
    Linear,
    drop_unread_weights,
    int8_linear,
    pack_linears,
    quantize_w8a8,
)

TEXT = Path(__file__).with_name("calibration.txt")
ALPHA = 0.5
CHUNK = 512
"""Tokens per forward: the text runs as independent chunks of this length."""


def _run_text(model: CausalLM, token_ids: list[int]) -> None:
    """A forward over token_ids, in chunks of CHUNK, each from position 0."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(token_ids), CHUNK):
            chunk = torch.tensor(token_ids[start : start + CHUNK], device=device)
            positions = torch.arange(len(chunk), device=device)
            model.logits(model(chunk, positions, DenseKV(model.cfg.num_layers)))


def _observe(
    run: Callable[[], None],
    layers: list[Linear],
    record: Callable[[Linear, tuple[torch.Tensor, ...]], None],
) -> None:
    """`run()` with `record` called on each of layers' inputs."""
    hooks = [m.register_forward_pre_hook(record) for m in layers]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()


def _maxima(run: Callable[[], None], layers: list[Linear]) -> dict[Linear, torch.Tensor]:
    """The largest magnitude of each input channel of each of layers, in float32, over
    `run()`."""
    maxima: dict[Linear, torch.Tensor] = {}

    def record(layer: Linear, args: tuple[torch.Tensor, ...]) -> None:
        seen = args[0].detach().abs().amax(0).float()
        maxima[layer] = torch.maximum(maxima[layer], seen) if layer in maxima else seen

    _observe(run, layers, record)
    return maxima


def activation_maxima(model: CausalLM, token_ids: list[int]) -> dict[Linear, torch.Tensor]:
    """The largest magnitude of each input channel of every `Linear`, in float32, over a
    forward of token_ids (in chunks of CHUNK, each from position 0)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return _maxima(lambda: _run_text(model, token_ids), linears)


def choose_w8a8_inputs(model: CausalLM, token_ids: list[int]) -> int:
    """For a GEMM that sums pairs of int8 products in int16 (AVX2): each w8a8 layer, quantized
    with 7-bit inputs (`quantize_w8a8`'s default there), keeps that form or takes 7-bit weights
    instead, whichever puts its output over token_ids closer (squared error) to the product of
    its unquantized weight. On SmolLM2-135M the LM head and the attention outputs keep 7-bit
    inputs and the rest take 7-bit weights. A split layer (8 bits both: `Linear.exact_int8`)
    stays as it is. Returns how many layers keep 7-bit inputs."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return _choose(lambda: _run_text(model, token_ids), linears)


def _choose(run: Callable[[], None], layers: list[Linear]) -> int:
    """`choose_w8a8_inputs` for `layers`, their inputs observed over `run()` (a forward of
    the quantized model, or a part of one: `LayerwiseCalibration.choose`)."""
    errors: dict[Linear, list[float]] = {}
    other: dict[Linear, Int8Form] = {}
    for layer in layers:
        if layer.int8 is not None:
            smooth = layer.int8.smooth
            if layer.int8.low is not None:  # split: 8 bits both already
                continue
            weight = layer.weight.detach().float() * (1 if smooth is None else smooth)
            other[layer] = Int8Form(*quantize_w8a8(weight, seven_bit_inputs=False), smooth)
            errors[layer] = [0.0, 0.0]

    def record(layer: Linear, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].detach()
        exact = F.linear(x.float(), layer.weight.detach().float())
        for i, form in enumerate((layer.int8, other[layer])):
            assert form is not None
            errors[layer][i] += (int8_linear(x, *form).float() - exact).square().sum().item()

    _observe(run, list(other), record)
    for layer, (seven_inputs, seven_weights) in errors.items():
        if seven_weights < seven_inputs:
            layer.int8 = other[layer]
    return sum(layer.int8 is not other[layer] for layer in other)


def _factors(
    maxima: dict[Linear, torch.Tensor], alpha: float = ALPHA
) -> dict[Linear, torch.Tensor]:
    """Per `Linear` of maxima (its inputs' channel maxima): its input channels' factors s
    (float32), for x / s @ (W * s).T."""
    factors = {}
    for layer, act in maxima.items():
        weight = layer.weight.detach().float().abs().amax(0)
        s = act.clamp(min=1e-5) ** alpha / weight.clamp(min=1e-5) ** (1 - alpha)
        factors[layer] = s.clamp(min=1e-5)
    return factors


def smoothing_factors(
    model: CausalLM, token_ids: list[int], alpha: float = ALPHA
) -> dict[Linear, torch.Tensor]:
    """Per `Linear`: its input channels' factors s (float32), for x / s @ (W * s).T."""
    return _factors(activation_maxima(model, token_ids), alpha)


class LayerwiseCalibration:
    """`smoothing_factors` taken layer by layer, as a checkpoint is read in layer order: each
    decoder layer runs over the text's chunks once its weights are in (`layer(i)` gives its
    Linears' factors, after which it may be quantized and its bf16 weights dropped), the LM
    head last (`head()`). Each chunk's hidden states between layers are what the whole
    model's forward computes, so the factors are the same bits; the load holds one layer in
    bf16, not the model. `choose`: `choose_w8a8_inputs` too (an int16-pair int8 GEMM), each
    layer once it is quantized (`choose(i)`, `choose_head()`), over a second stream of hidden
    states through the quantized layers, as that function's forward computes them. For a
    model whose forward is `CausalLM.forward` (the embedding, the layers in order, the final
    norm), on one rank; the embedding must be loaded first."""

    def __init__(self, model: CausalLM, token_ids: list[int], choose: bool = False) -> None:
        first = cast(DecoderLayer, model.model.layers[model.model.local.start])
        dtype = first.input_layernorm.weight.dtype  # as `CausalLM.forward` takes its RoPE
        device = next(model.parameters()).device
        self.model = model
        self.chunks: list[_Chunk] = []
        with torch.inference_mode():
            for start in range(0, len(token_ids), CHUNK):
                ids = torch.tensor(token_ids[start : start + CHUNK], device=device)
                positions = torch.arange(len(ids), device=device)
                embedded = model.embed(ids).float()
                streams = [_Stream(embedded, DenseKV(model.cfg.num_layers))]
                if choose:  # the quantized model's, from the same embedding
                    streams.append(_Stream(embedded, DenseKV(model.cfg.num_layers)))
                self.chunks.append(_Chunk(model.layer_rope(positions, dtype), streams))

    def _run_layer(self, i: int, stream: int) -> Callable[[], None]:
        layer = self.model.model.layers[i]

        def run() -> None:
            with torch.inference_mode():
                for chunk in self.chunks:
                    cos, sin = chunk.rope(i)
                    s = chunk.streams[stream]
                    s.hidden = layer(s.hidden, cos, sin, s.kv)
                    s.kv.forget(i)  # needed only within this layer's run

        return run

    def _run_head(self, stream: int) -> Callable[[], None]:
        model = self.model

        def run() -> None:
            with torch.inference_mode():
                for chunk in self.chunks:
                    hidden, norm = chunk.streams[stream].hidden, model.model.norm
                    model.logits(hidden if norm is None else norm(hidden))

        return run

    def layer(self, i: int) -> dict[Linear, torch.Tensor]:
        """Decoder layer i's Linears' factors, its bf16 weights in; each chunk's hidden
        states move past it."""
        linears = [m for m in self.model.model.layers[i].modules() if isinstance(m, Linear)]
        return _factors(_maxima(self._run_layer(i, 0), linears))

    def head(self) -> dict[Linear, torch.Tensor]:
        """The LM head's factors, after every layer's."""
        assert self.model.lm_head is not None
        return _factors(_maxima(self._run_head(0), [self.model.lm_head]))

    def choose(self, i: int) -> int:
        """`choose_w8a8_inputs` for decoder layer i, quantized with its bf16 weights still in;
        the quantized stream moves past it. How many of its layers keep 7-bit inputs."""
        linears = [m for m in self.model.model.layers[i].modules() if isinstance(m, Linear)]
        return _choose(self._run_layer(i, 1), linears)

    def choose_head(self) -> int:
        """`choose` for the LM head, after every layer's."""
        assert self.model.lm_head is not None
        return _choose(self._run_head(1), [self.model.lm_head])


@dataclass(slots=True)
class _Stream:
    """A chunk's hidden states between layers, through the bf16 or the quantized model, and
    the KV of the layer running over it (let go once it has run)."""

    hidden: torch.Tensor
    kv: DenseKV


@dataclass(slots=True)
class _Chunk:
    """A chunk of the calibration text: its RoPE (by layer) and its streams."""

    rope: Callable[[int], Any]
    streams: list[_Stream]


class LayerwiseQuantization:
    """`iter_checkpoint_by_layer`'s `after_layer` for w8a8 and int4-w8a8 (`quantization`):
    once decoder layer i's weights are in, its factors (`LayerwiseCalibration`, begun at the
    first layer: the embedding is in by then), its forms (`pack_linears`, as the run plan's
    `native` and `pack` say; `choose`: each form's bits chosen, `choose_w8a8_inputs`), its
    bf16 weights dropped where no matmul reads them and the freed heap handed back; then the
    LM head's factors (`head()`) and, once it is quantized, its choice (`choose_head()`)."""

    def __init__(
        self,
        model: CausalLM,
        token_ids: list[int],
        quantization: str,
        native: bool,
        pack: str | None,
        choose: bool,
    ) -> None:
        self.model = model
        self.token_ids = token_ids
        self.quantization = quantization
        self.native = native
        self.pack = pack
        self.choose = choose
        self.calibration: LayerwiseCalibration | None = None
        self.kept = 0
        """Layers that kept 7-bit inputs (`choose`)."""

    def __call__(self, i: int) -> None:
        if self.calibration is None:
            self.calibration = LayerwiseCalibration(self.model, self.token_ids, self.choose)
        layer = self.model.model.layers[i]
        factors = self.calibration.layer(i)
        pack_linears(layer, self.quantization, factors, native=self.native, pack=self.pack)
        if self.choose:
            self.kept += self.calibration.choose(i)
        drop_unread_weights(layer, self.native)
        release_freed_memory()

    def head(self) -> dict[Linear, torch.Tensor] | None:
        """The LM head's factors (None where no layer came)."""
        return None if self.calibration is None else self.calibration.head()

    def choose_head(self) -> int | None:
        """The quantized LM head's choice (`choose`); how many layers in all keep 7-bit
        inputs (None where nothing is chosen)."""
        if not self.choose or self.calibration is None:
            return None
        self.kept += self.calibration.choose_head()
        return self.kept


def calibration_tokens(tokenizer: object) -> list[int]:
    """The built-in calibration text, tokenized."""
    return tokenizer(TEXT.read_text())["input_ids"]  # type: ignore[operator]
