"""DeepSeek-V4: compressed attention over `kv/kinds/compressed.py`, manifold hyper-connections
(`ops/hyper_connection.py`) and experts routed by score or by a token table, on llama.py's
decoder (its embedding, stage and head bookkeeping).

Parameter names are the checkpoint's own (DeepSeek's: `attn.wq_a`, `ffn.experts`, `hc_attn_fn`,
...), as transformers' `save_pretrained` writes them; `loader.py` stacks the routed experts and
names `head.weight` our `lm_head`.

Attention is multi-query with one shared KV head, keys and values the same roped tensor:
    q = rope(rms(wq_b(q_norm(wq_a(x)))))         per head, rope on the last qk_rope_head_dim
    kv = rope(norm(wkv(x)))                      one head
    out = attend(window + compressed entries, sinks); rope⁻¹(out) per head
    wo_b(wo_a(out by o_groups))                  the grouped output projection
Sliding-window-only layers rotate with the "main" RoPE, compressed layers (and their
compressors and indexers) with the "compress" one. The layers compile like the others'
(`executor/compiled.py`), the paged attention an opaque custom op of their graphs
(`pypto::compressed_attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from pypto_serving.distributed import Group, ParallelGroups
from pypto_serving.kv.kinds import AttentionKind, compressed
from pypto_serving.models.config import CompressedAttentionConfig, ModelConfig
from pypto_serving.models.llama import CausalLM, Decoder, DecoderLayer, RoutedExperts
from pypto_serving.ops.attention import KVAttention
from pypto_serving.ops.hyper_connection import (
    hyper_head,
    hyper_residual,
    hyper_weights,
    unweighted_rms_norm,
)
from pypto_serving.ops.linear import Linear, RowParallelLinear
from pypto_serving.ops.moe import clamp_swiglu, route_scored
from pypto_serving.ops.norm import RMSNorm
from pypto_serving.ops.rope import apply_rope_interleaved, rope_angles

Angles = tuple[torch.Tensor, torch.Tensor]


class Compressor(nn.Module):
    """Pools each window of `ratio` tokens into one entry (`compressed.pool_windows`, over its
    `pooling`): its kv and gate projections, a learned bias per slot (`ape`), a norm. With
    `overlap` (CSA and its indexer) each token projects two series."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = (2 if overlap else 1) * dim
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.wkv = Linear(hidden, width, bias=False)
        self.wgate = Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.empty(ratio, width))
        self.norm = RMSNorm(dim, eps)
        self.inv_freq: torch.Tensor | None = None
        """The compressed RoPE's frequencies (set by the model)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' (kv, gate) projections, the compressor's rows, in float32."""
        return self.wkv(x).float(), self.wgate(x).float()

    @property
    def pooling(self) -> compressed.Pooling:
        """Its weights for pooling windows into entries."""
        assert self.inv_freq is not None
        norm = self.norm
        return compressed.Pooling(
            self.ratio, self.overlap, self.ape, norm.weight, norm.eps, self.inv_freq
        )


class Indexer(nn.Module):
    """CSA's lightning indexer: its own overlapping compressor at index_head_dim, queries from
    the attention's low-rank query, and per-head weights of each query's score."""

    def __init__(self, cfg: ModelConfig, v4: CompressedAttentionConfig, ratio: int) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = v4.index_heads, v4.index_head_dim, v4.index_topk
        self.compressor = Compressor(cfg.hidden_size, self.dim, ratio, True, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = Linear(cfg.hidden_size, self.heads, bias=False)
        self.scale = (self.dim * self.heads) ** -0.5

    def forward(
        self, x: torch.Tensor, q_low: torch.Tensor, angles: Angles
    ) -> compressed.IndexerInputs:
        kv, gate = self.compressor(x)
        q = apply_rope_interleaved(self.wq_b(q_low).view(len(x), self.heads, self.dim), *angles)
        weights = self.weights_proj(x).float() * self.scale
        pooling = self.compressor.pooling
        return compressed.IndexerInputs(kv, gate, pooling, q, weights, self.topk)


class CompressedAttention(nn.Module):
    """One V4 attention layer: the sliding window, and its compressor (and indexer) if any.

    Under tensor parallelism (`cfg` this rank's share) a rank holds its heads' query rows
    (`wq_b`), sinks and output groups (`wo_a`, and `wo_b`'s columns: row-parallel, one
    all-reduce); the low-rank query, the one KV head, the compressor and the indexer are whole
    on every rank, so every rank stores the same KV (`same_on_tp_ranks`)."""

    def __init__(self, cfg: ModelConfig, layer: int, index: int, tp: Group) -> None:
        super().__init__()
        v4 = cfg.compressed
        assert v4 is not None
        self.cfg, self.window = cfg, v4.sliding_window
        self.layer = torch.tensor(layer, device="cpu")  # a graph input: see llama.Attention
        heads, dim, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
        self.ratio = v4.compress_ratios[index]
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps)
        self.wq_b = Linear(cfg.q_lora_rank, heads * dim, bias=False)
        self.wkv = Linear(cfg.hidden_size, dim, bias=False)
        for qk in (self.wq_a, self.wq_b, self.wkv):
            qk.exact_int8 = True  # queries and keys (and values): 8 bits both under w8a8
        self.norm = RMSNorm(dim, eps)
        self.groups = v4.o_groups
        self.wo_a = GroupedLinear(heads * dim // v4.o_groups, v4.o_lora_rank, v4.o_groups)
        self.wo_b = RowParallelLinear(v4.o_groups * v4.o_lora_rank, cfg.hidden_size, False, tp)
        self.attn_sink = nn.Parameter(torch.empty(heads))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.ratio:
            overlap = v4.indexed[index]
            self.compressor = Compressor(cfg.hidden_size, dim, self.ratio, overlap, eps)
            self.indexer = Indexer(cfg, v4, self.ratio) if overlap else None

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, angles: Angles, kv: KVAttention
    ) -> torch.Tensor:
        cfg = self.cfg
        q_low = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_low).view(len(x), cfg.num_heads, cfg.head_dim)
        q = apply_rope_interleaved(unweighted_rms_norm(q, cfg.rms_norm_eps), *angles)
        raw = apply_rope_interleaved(self.norm(self.wkv(x)), *angles)
        compression = None
        if self.compressor is not None:
            rows = self.compressor(x)
            indexer = None if self.indexer is None else self.indexer(x, q_low, angles)
            pooling = self.compressor.pooling
            compression = compressed.Compression(self.ratio, rows[0], rows[1], pooling, indexer)
        out = compressed.attend(
            kv, self.layer, q, positions, raw, self.attn_sink, self.window, compression
        )
        cos, sin = angles
        out = apply_rope_interleaved(out, cos, -sin)  # keys were values: undo their rotation
        out = self.wo_a(out.reshape(len(x), self.groups, -1))
        return self.wo_b(out.flatten(1))


class GroupedLinear(nn.Module):
    """The grouped output projection's first half: each group of heads [T, g, in] projected
    by its own block of `weight` [g * out, in] to [T, g, out]."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.bmm(x.transpose(0, 1).to(w.dtype), w.transpose(1, 2)).transpose(0, 1)


class SharedExpert(nn.Module):
    """The shared expert: a clamped SwiGLU MLP (w1 gate, w3 up, w2 down). Under tensor
    parallelism a rank holds its columns: its output is a partial sum, which joins the routed
    experts' all-reduce (`RoutedExperts.experts`' `partial`)."""

    def __init__(self, cfg: ModelConfig, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = Linear(cfg.hidden_size, cfg.shared_intermediate_size, bias=False)
        self.w3 = Linear(cfg.hidden_size, cfg.shared_intermediate_size, bias=False)
        self.w2 = Linear(cfg.shared_intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.limit > 0:
            gate, up = clamp_swiglu(gate, up, self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    """The router's weights: a score projection, and either the score bias of a learned
    choice or a hash layer's token-to-experts table (`tid2eid`)."""

    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if hashed:
            table = torch.empty(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long)
            self.tid2eid = nn.Parameter(table, requires_grad=False)
        else:
            self.bias = nn.Parameter(torch.empty(cfg.num_experts))


class V4MoE(RoutedExperts):
    """Routed experts (this rank's, under expert parallelism) plus the shared expert."""

    float32_routing: ClassVar[bool] = True

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, index: int) -> None:
        super().__init__(cfg, groups)
        v4 = cfg.compressed
        assert v4 is not None
        self.v4, self.swiglu_limit = v4, v4.swiglu_limit
        self.hashed = index in v4.hash_layers
        self.gate = Gate(cfg, self.hashed)
        self.shared_experts = SharedExpert(cfg, v4.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        cfg, gate = self.cfg, self.gate
        logits = F.linear(x.float(), gate.weight.float())
        fixed = gate.tid2eid[input_ids] if self.hashed else None
        bias = None if self.hashed else gate.bias
        ids, weights = route_scored(
            logits,
            self.v4.scoring_func,
            cfg.num_experts_per_tok,
            bias,
            fixed,
            cfg.routed_scaling_factor,
        )
        return self.experts(x, ids, weights, self.shared_experts(x).float())


class V4DecoderLayer(DecoderLayer):
    """Attention and experts, each between hyper-connections of the residual streams."""

    def __init__(self, cfg: ModelConfig, layer: int, groups: ParallelGroups, index: int) -> None:
        nn.Module.__init__(self)
        v4 = cfg.compressed
        assert v4 is not None
        self.v4, self.eps = v4, cfg.rms_norm_eps
        n, hidden = v4.hc_mult, cfg.hidden_size
        self.attn_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.attn = CompressedAttention(cfg, layer, index, groups.tp)
        self.ffn_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.ffn = V4MoE(cfg, groups, index)
        for block in ("attn", "ffn"):
            self.register_parameter(
                f"hc_{block}_fn", nn.Parameter(torch.empty((2 + n) * n, n * hidden))
            )
            self.register_parameter(f"hc_{block}_base", nn.Parameter(torch.empty((2 + n) * n)))
            self.register_parameter(f"hc_{block}_scale", nn.Parameter(torch.empty(3)))

    def hyper(self, block: str, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fn, base, scale = (getattr(self, f"hc_{block}_{w}") for w in ("fn", "base", "scale"))
        return hyper_weights(
            streams, fn, base, scale, self.v4.hc_sinkhorn_iters, self.v4.hc_eps, self.eps
        )

    def forward(  # type: ignore[override]
        self,
        streams: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVAttention,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """streams [T, hc_mult, hidden] float32 -> the streams after this layer; cos, sin: its
        RoPE's angles (the main or the compressed one, `layer_rope`)."""
        post, comb, x = self.hyper("attn", streams)
        out = self.attn(self.attn_norm(x), positions, (cos, sin), kv)
        streams = hyper_residual(streams, out, post, comb)
        post, comb, x = self.hyper("ffn", streams)
        out = self.ffn(self.ffn_norm(x), input_ids)
        return hyper_residual(streams, out, post, comb)


class HyperHead(nn.Module):
    """The residual streams' final collapse, before the model's norm."""

    def __init__(self, cfg: ModelConfig, n: int) -> None:
        super().__init__()
        self.hc_fn = nn.Parameter(torch.empty(n, n * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))


class DeepseekV4ForCausalLM(CausalLM):
    """DeepseekV4ForCausalLM: the forward runs its layers over the residual streams, compiled
    (through `run_layer`, with the token ids and positions the layers take) unless
    --enforce-eager. Under pipeline parallelism a stage passes the streams [T, hc_mult,
    hidden] on (`stage_output_shape`), and the last collapses them (`hc_head`)."""

    layer_type = V4DecoderLayer
    attention_kind: ClassVar[AttentionKind] = compressed
    main_inv_freq: torch.Tensor
    compress_inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups | None = None) -> None:
        super().__init__(cfg, groups)
        v4 = cfg.compressed
        assert v4 is not None
        self.v4 = v4
        if self.last_stage:
            self.model.hc_head = HyperHead(cfg, v4.hc_mult)
        self.register_buffer("main_inv_freq", torch.tensor(v4.main_inv_freq), persistent=False)
        compress_inv = torch.tensor(v4.compress_inv_freq)
        self.register_buffer("compress_inv_freq", compress_inv, persistent=False)

    def set_rope(self, device: torch.device) -> None:
        """The RoPE tables in float32 on `device` (after loading), given to the compressors."""
        v4 = self.v4
        self.main_inv_freq = torch.tensor(v4.main_inv_freq, dtype=torch.float32, device=device)
        compress = torch.tensor(v4.compress_inv_freq, dtype=torch.float32, device=device)
        self.compress_inv_freq = compress
        for module in self.modules():
            if isinstance(module, Compressor):
                module.inv_freq = compress

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVAttention,
        hidden: torch.Tensor | None = None,
        run_layer: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] (a flat batch) -> normed hidden states [T, hidden] (on the
        last stage; an earlier one returns its streams, and a later one takes them as
        `hidden`); run_layer: as `CausalLM.forward`'s, given the token ids and positions too."""
        v4, decoder = self.v4, self.model
        rope = self.layer_rope(positions, torch.float32)
        if decoder.embed_tokens is not None:
            embedded = decoder.embed_tokens(input_ids).float()
            streams = embedded[:, None, :].expand(-1, v4.hc_mult, -1).contiguous()
        else:
            assert hidden is not None, "a later pipeline stage takes the streams"
            streams = hidden
        for i in decoder.local:
            layer = decoder.layers[i]
            cos, sin = rope(i)
            streams = (
                layer(streams, cos, sin, kv, input_ids, positions)
                if run_layer is None
                else run_layer(layer, streams, cos, sin, kv, input_ids, positions)
            )
        if decoder.norm is None:
            return streams
        head = cast(HyperHead, decoder.hc_head)
        collapsed = hyper_head(
            streams, head.hc_fn, head.hc_base, head.hc_scale, v4.hc_eps, self.cfg.rms_norm_eps
        )
        return decoder.norm(collapsed)

    def stage_output_shape(self, tokens: int) -> tuple[int, ...]:
        """What an earlier pipeline stage sends on: the residual streams."""
        return (tokens, self.v4.hc_mult, self.cfg.hidden_size)

    def layer_rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        """Layer i's RoPE angles [T, rope / 2] in float32: the compressed one for compressed
        layers, the main one for the window-only ones."""
        angles = {
            0: rope_angles(positions, self.main_inv_freq),
            1: rope_angles(positions, self.compress_inv_freq),
        }
        return lambda i: angles[1 if self.v4.compress_ratios[i] else 0]


__all__ = ["Decoder", "DeepseekV4ForCausalLM"]
