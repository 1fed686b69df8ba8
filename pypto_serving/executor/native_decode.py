"""The native decode step: a step of a few decodes as one C++ call (native/decode.cpp).

Decoding one or a few sequences is memory-bound: a token reads every weight once. Through the
compiled layer graphs each of SmolLM2's 30 layers still costs a dozen kernel launches, the
attention op's dispatch and Python around each, about as much as its matmuls; one C++ call
for the whole forward (embedding, every layer, the final norm and the LM head) leaves only
the reading of the weights, in llama.cpp's formats (Q4_1 layers, a Q8_0 head: `pack_q4`,
`pack_q8`) with int8 dot products over activations quantized per 32 (Q8_1). Steps of more
decodes than the plan's `native_rows` (all of them when the records are a model's only
weights, else FEW_ROWS), or with a prefill chunk, run on the compiled graphs as before.

It applies (`applies`) to bf16 models on the CPU, unquantized or int4 / int4-w8a8, one rank
or tensor-parallel ranks on one machine (each runs its share and calls the shared-memory
collectives from C++: `distributed.shm_group`), dense layers, and attention shapes the native
kernels take. An int4 model's Linears then hold the packed forms (`Linear.native`), built by
the loader; an unquantized model's plain bf16 weights are read where they lie (bf16 dot
products), so a decode of one reads SmolLM2's 269 MB once at the memory's speed. The
structures below mirror decode.cpp's.
"""

from __future__ import annotations

import ctypes
import logging
import time
from ctypes import POINTER, c_float, c_int32, c_int64, c_void_p

import torch

from pypto_serving.device import cpu_flags, cpu_isa
from pypto_serving.distributed import ParallelGroups, shm_group
from pypto_serving.executor.team_size import TeamSize
from pypto_serving.kv import native_attention
from pypto_serving.kv.paged_cache import PagedCache
from pypto_serving.models.config import ModelConfig
from pypto_serving.models.llama import MLP, Attention, CausalLM, DecoderLayer
from pypto_serving.native import Matrix
from pypto_serving.ops.linear import INT4_GROUP, NATIVE_BF16, Linear

log = logging.getLogger(__name__)

MAX_ROWS = 256
"""Sequences a native step takes at most (decode.cpp's MAX_ROWS): a model whose every matmul
there reads records (`rows_taken`) runs every step of decodes alone here, as wide as the
records' product goes on the graphs, without the graphs' per-layer dispatch."""
FEW_ROWS = 8
"""Sequences a native step takes of a bf16 model (whose weights the step reads one dot
product at a time): up to here the weights' bytes dominate; wider steps are compute-bound and
run on the compiled graphs."""
ROW_BLOCK = 8
"""Rows the native step's products take at once (records.h's BLOCK_ROWS): each block of rows
unpacks every weight again, so a step's ninth row cost about what its first did (SmolLM2
from its GGUF, AVX-512: 8 rows 9.4 ms, 9 rows 15.5 ms, 16 rows 21.8 ms). On AVX-512 VNNI a
last 9 or 10 rows run as one block (records.h's WIDE_ROWS, `NativeDecoder.wide_rows`), the
ninth row about an eighth more than 8: the drafts a step may add fill the decodes' last
block up to there."""
QUANTIZATIONS = (None, "int4", "int4-w8a8", "gguf")
"""Quantizations whose weights the step reads: bf16 or the records `pack_linears` makes."""


class _Layer(ctypes.Structure):
    _fields_ = [
        *[(name, c_void_p) for name in ("input_norm", "post_norm", "q_norm", "k_norm")],
        *[(name, Matrix) for name in ("qkv", "o", "gate_up", "down")],
        ("k_cache", c_void_p),
        ("v_cache", c_void_p),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *[
            (name, c_int32)
            for name in (
                "num_layers",
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "intermediate",
                "vocab",
                "kv_int8",
                "page_size",
            )
        ],
        ("eps", c_float),
        ("rope_scaling", c_float),
        ("head_stride", c_int64),
        *[(name, c_void_p) for name in ("inv_freq", "embed", "final_norm")],
        ("lm_head", Matrix),
        ("layers", POINTER(_Layer)),
        ("world", c_int32),
        ("vocab_start", c_int64),
        ("embed_rows", c_int64),
        *[(name, c_void_p) for name in ("comm", "all_reduce", "all_gather")],
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("rows", c_int32),
        ("width", c_int32),
        ("threads", c_int32),
        *[
            (name, c_void_p)
            for name in ("tokens", "positions", "slots", "block_table", "ctx_lens", "logits")
        ],
        ("timeout_s", ctypes.c_double),
        ("who", c_void_p),
    ]


def applies(
    cfg: ModelConfig,
    quantization: str | None,
    dtype: torch.dtype,
    groups: ParallelGroups,
    page_size: int,
    records_only: bool = False,
) -> bool:
    """Whether the native step can run this model's decodes (its kind's, where the run plan
    runs the step: engine/plan.py): bf16 weights or records (int4's, a GGUF file's; any
    quantization's where they are the weights' only form, `records_only`: int8's Q8 is read
    only there) in bf16, one rank or TP ranks joined by
    shared memory (no pipeline), no mixture-of-experts layer, sizes (each rank's) in whole
    groups of 32, and an attention shape the native kernels take."""
    tp = groups.tp.size
    sizes = (cfg.hidden_size, cfg.intermediate_size // tp, cfg.q_size // tp)
    return (
        (quantization in QUANTIZATIONS or records_only)
        and dtype == torch.bfloat16
        and (groups.world_size == 1 or (groups.pp.size == 1 and shm_group() is not None))
        and not cfg.moe_layers
        and all(n % INT4_GROUP == 0 for n in sizes)
        and native_attention.takes(dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page_size)
    )


def rows_taken(quantization: str | None) -> int:
    """The most decodes one native step takes (the run plan's `native_rows`): MAX_ROWS where
    every matmul of the step reads records (any quantization the step runs: int4's, int4-w8a8's
    and a GGUF file's Q4/Q8, or the records a `records_only` model keeps alone), whose products
    take 8 rows a pass over the weights at the int8 dot products' rate however many rows come;
    FEW_ROWS where it reads bf16 weights. int4-w8a8's int8 GEMM then serves its prefill chunks."""
    return FEW_ROWS if quantization is None else MAX_ROWS


def draft_row_cost(quantization: str | None) -> float:
    """What one more row of a sequence (a speculative draft's) adds to a native step, as a
    fraction of a step of one row with Python's part of it (~1 ms): the products' arithmetic
    per row against the weights' bytes read once. SmolLM2 at context 150, `bench/native_rows.py
    --rows 1,8` (AMD Zen 4): its records with AVX512-VNNI (one vpdpbusd a 64-byte dot product)
    4.46 / 6.77 ms, 0.06 a row (the 1B shape: 0.07); on the AVX2 build (vpmaddubsw, vpmaddwd
    and an add a 32-byte one) 3.80 / 11.43 ms, 0.23; bf16 weights (`FEW_ROWS`) 10.02 / 20.56
    ms, 0.14. The Speculator weighs its drafts' worth by it (`speculative.worth_drafting`)."""
    if quantization is None:
        return 0.15
    return 0.08 if cpu_isa() == "avx512" and "avx512_vnni" in cpu_flags() else 0.25


def matrix(layer: Linear, bias_here: bool = True) -> Matrix:
    """A Linear's weight (and bias, unless not `bias_here`: a row-parallel layer's is added
    by rank 0's share only) as decode.cpp reads it: its packed form where the loader made one
    (int4 models), else its plain bf16 weight."""
    bias = None if layer.bias is None or not bias_here else layer.bias.data_ptr()
    if layer.native is None:
        weight = layer.weight
        assert weight.dtype == torch.bfloat16 and weight.is_contiguous()
        return Matrix(weight.data_ptr(), bias, layer.out_features, layer.in_features, NATIVE_BF16)
    records, fmt = layer.native
    return Matrix(records.data_ptr(), bias, layer.out_features, layer.in_features, fmt)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeDecoder:
    """Runs decode steps of up to MAX_ROWS sequences of `model` over the attention operator's
    GQA cache `kv` through `lib`. The structures it hands decode.cpp point into the model's and
    the cache's tensors, which live as long as it does."""

    def __init__(self, model: CausalLM, kv: PagedCache, lib: ctypes.CDLL) -> None:
        cfg, decoder = model.cfg, model.model
        assert model.lm_head is not None and decoder.embed_tokens is not None
        assert decoder.norm is not None
        self.lib, self.vocab = lib, cfg.vocab_size
        self.wide_rows: int = lib.pypto_native_wide_rows()
        """The most rows this build's products take in a last block (ROW_BLOCK, or 10)."""
        self.team = TeamSize(torch.get_num_threads())
        tp, self.comm = model.groups.tp, shm_group()
        assert tp.size == 1 or self.comm is not None
        hooks = self.comm.native_calls() if self.comm is not None else (None, None, None, None)
        self._who = hooks[3]
        layers = []
        for i, layer in enumerate(decoder.layers):
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            assert isinstance(attn, Attention) and isinstance(mlp, MLP)
            layers.append(
                _Layer(
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    _ptr(attn.q_norm.weight) if cfg.qk_norm else None,
                    _ptr(attn.k_norm.weight) if cfg.qk_norm else None,
                    matrix(attn.qkv_proj),
                    matrix(attn.o_proj, tp.rank == 0),
                    matrix(mlp.gate_up_proj),
                    matrix(mlp.down_proj, tp.rank == 0),
                    kv.k_cache[i].data_ptr(),
                    kv.v_cache[i].data_ptr(),
                )
            )
        self._layers = (_Layer * len(layers))(*layers)
        self._inv_freq = model.inv_freq.float().contiguous()
        slots, row = kv.k_cache.shape[2:]
        self._model = _Model(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            model.lm_head.out_features,  # this rank's rows of the (padded) vocabulary
            kv.k_cache.dtype == torch.int8,
            kv.page_size,
            cfg.rms_norm_eps,
            cfg.rope_scaling,
            slots * row,
            self._inv_freq.data_ptr(),
            _ptr(decoder.embed_tokens.weight),  # None: the LM head's Q8 records (tied)
            decoder.norm.weight.data_ptr(),
            matrix(model.lm_head),
            self._layers,
            tp.size,
            decoder.embed_tokens.start,
            decoder.embed_tokens.shard,
            *hooks[:3],
        )
        self._gathered = model.lm_head.out_features * tp.size

    def logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        ctx_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Float32 logits [B, vocab] of B <= MAX_ROWS decodes (one new token each: tokens,
        positions, their KV slots and block_table [B, W] as the attention operator mapped them
        (`StepAttention`), and context lengths, the new token included, all int64), whose keys
        and values it writes into the KV cache. Rows of one sequence (speculative drafts,
        each at its position) attend over each other's keys: decode.cpp writes them all
        first."""
        rows = len(tokens)
        tables = [t.contiguous() for t in (tokens, positions, slots, block_table, ctx_lens)]
        out = torch.empty(rows, self._gathered)
        threads = self.team.threads()  # fewer where another process competes for the cores
        pointers = (*(t.data_ptr() for t in tables), out.data_ptr())
        timeout = self.comm.timeout_s if self.comm is not None else 0.0
        step = _Step(rows, block_table.shape[1], threads, *pointers, timeout, self._who)
        start = time.perf_counter()
        status = self.lib.pypto_decode_step(ctypes.byref(self._model), ctypes.byref(step))
        if status >= 10 and self.comm is not None:
            self.comm.check(status - 10, "collective of the native decode step")
        if status:
            raise ValueError(f"the native decode step does not take {rows} rows")
        self.team.record(rows, threads, time.perf_counter() - start)
        return out if self._gathered == self.vocab else out[:, : self.vocab]
