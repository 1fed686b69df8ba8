"""The Llama family (Llama, Qwen2, Qwen3, Qwen3-MoE) as one decoder-only transformer.

Parameter names follow Hugging Face's, except that q/k/v and gate/up are fused into
`qkv_proj` and `gate_up_proj`; `loader.py` is the one place that maps HF tensors onto them.
The model works on a flat batch of tokens [T] (sequences concatenated) and leaves all
KV-cache handling to its attention kind (`kv/kinds/gqa.py`), with the `KVAttention` it is
given. Matmuls run in the weights' dtype
(bf16 or fp32); the residual stream is kept in float32, as llama.cpp keeps its activations,
so bf16 weights cost little accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, cast

import torch
from torch import nn

from pypto_serving.distributed import Group, ParallelGroups, tp_all_gather
from pypto_serving.kv.kinds import AttentionKind, gqa
from pypto_serving.models.config import ModelConfig
from pypto_serving.ops.activation import silu_and_mul
from pypto_serving.ops.attention import KVAttention
from pypto_serving.ops.linear import Linear, RowParallelLinear, VocabParallelEmbedding
from pypto_serving.ops.moe import (
    ExpertRecords,
    column_owners,
    expert_owners,
    expert_placement,
    join_exchange,
    route,
    routed_experts,
)
from pypto_serving.ops.norm import RMSNorm
from pypto_serving.ops.rope import apply_rope, rope_cos_sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: Group) -> None:
        super().__init__()
        self.cfg = cfg
        # a tensor, not an int: an int would be a constant of a compiled layer's graph, so
        # each layer would compile its own; a tensor is an input, and all layers share one
        # graph. Kept on the CPU (the model may be built on "meta", and moved to a GPU).
        self.layer = torch.tensor(layer, device="cpu")
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.qkv_proj.exact_int8 = True  # queries and keys: 8 bits both under w8a8
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, cfg.o_bias, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention
    ) -> torch.Tensor:
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(kv, q, k, v)
        return self.o_proj(out.reshape(-1, cfg.q_size))

    def attend(
        self, kv: KVAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """The layer's attention over its kind's KV: GQA's here; a model of another kind
        overrides it."""
        return gqa.attend(kv, self.layer, q, k, v)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Group) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class RoutedExperts(nn.Module):
    """The routed experts a rank holds (all of them, or its share under expert parallelism)
    and how it reaches the others' (`ops/moe.py`'s `routed_experts`, by the groups'
    `expert_exchange`). A model's MoE block subclasses it with its router."""

    float32_routing: ClassVar[bool] = False
    """The router's weights are float32 (else the model's dtype)."""
    experts_gate_up_bias: nn.Parameter | None
    experts_down_bias: nn.Parameter | None
    """The experts' biases (gpt-oss's), stacked as their weights; None: none."""
    records: ExpertRecords | None = None
    """The experts as records instead of the stacks `experts_gate_up` and `experts_down` (then
    None): a GGUF file's own Q4_1 / Q8_0 experts (`--quantization gguf`, one rank)."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__()
        self.cfg, ep = cfg, groups.ep
        self.held = expert_placement(cfg.num_experts, ep.rank, ep.size, groups.expert_placement)
        """Global ids of the experts this rank holds, in the order of the stacks below."""
        n, size, hidden = len(self.held), cfg.moe_intermediate_size, cfg.hidden_size
        self.experts_gate_up = nn.Parameter(torch.empty(n, 2 * size, hidden))
        self.experts_down = nn.Parameter(torch.empty(n, hidden, size))
        self.exchange = groups.expert_exchange
        self.owners = expert_owners(cfg.num_experts, ep.size, groups.expert_placement)
        self.reduce_tp = self.exchange not in ("none", "all_reduce") and groups.tp.size > 1
        """DP attention + EP with TP ranks: this rank reaches its column's experts, and the
        columns' sums meet in an all-reduce over the replica's TP ranks."""
        if self.reduce_tp:
            self.owners = column_owners(self.owners, groups.tp.rank, groups.tp.size)
        self.swiglu_limit = 0.0
        """Clamp the experts' gate and up projections (DeepSeek-V4's, gpt-oss's; 0: none)."""
        self.swiglu_alpha = 0.0
        """gpt-oss's gate activation (`ops/moe.py`'s `activate`; 0: SiLU)."""
        self.register_parameter("experts_gate_up_bias", None)
        self.register_parameter("experts_down_bias", None)

    def experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        partial: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every token's routed experts' weighted outputs (plus `partial`), float32 [T, H]."""
        gate_up: torch.Tensor = self.experts_gate_up
        down: torch.Tensor = self.experts_down
        formats = (0, 0)
        if (r := self.records) is not None:
            gate_up, down, formats = r.gate_up, r.down, (r.gate_up_format, r.down_format)
        return routed_experts(
            x,
            ids,
            weights,
            gate_up,
            down,
            self.held,
            self.exchange,
            self.owners,
            partial,
            self.swiglu_limit,
            self.swiglu_alpha,
            self.experts_gate_up_bias,
            self.experts_down_bias,
            self.reduce_tp,
            formats,
        )

    def join_idle(self) -> None:
        """DP attention + EP, no tokens here this step: join the layer's token exchange."""
        dtype = torch.float32 if self.float32_routing else self.experts_gate_up.dtype
        join_exchange(
            self.experts_gate_up,
            self.experts_down,
            self.held,
            self.cfg.num_experts_per_tok,
            self.exchange,
            dtype,
            self.swiglu_limit,
            self.swiglu_alpha,
            self.experts_gate_up_bias,
            self.experts_down_bias,
        )


class MoE(RoutedExperts):
    """Qwen3-MoE's sparse block: a router (replicated) and the routed experts."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups) -> None:
        super().__init__(cfg, groups)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        """The router: a plain nn.Linear, which no quantization or packing touches (its
        choices are the experts'), as vLLM's and llama.cpp's routers (F32 in GGUF files)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        ids, weights = route(self.gate(x), cfg.num_experts_per_tok, cfg.norm_topk_prob, x.dtype)
        return self.experts(x, ids, weights)


class DecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward blocks; a model of another kind (models/deepseek.py)
    subclasses it with its own `attention` and `feed_forward`, keeping `forward`."""

    def __init__(self, cfg: ModelConfig, layer: int, groups: ParallelGroups, index: int) -> None:
        """layer: its index in this stage's KV store; index: in the checkpoint."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention(cfg, layer, groups, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.feed_forward(cfg, groups, index)

    def attention(
        self, cfg: ModelConfig, layer: int, groups: ParallelGroups, index: int
    ) -> nn.Module:
        """The layer's attention (`layer`: its index in the stage's KV; `index`: in the
        checkpoint)."""
        return Attention(cfg, layer, groups.tp)

    def feed_forward(self, cfg: ModelConfig, groups: ParallelGroups, index: int) -> nn.Module:
        return MoE(cfg, groups) if index in cfg.moe_layers else MLP(cfg, groups.tp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVAttention
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


def stage_layers(num_layers: int, pp: Group) -> range:
    """The layers of pipeline stage `pp.rank`: contiguous, the counts differing by at most one
    (the later stages take the extra ones: the first holds the embedding)."""
    return range(num_layers * pp.rank // pp.size, num_layers * (pp.rank + 1) // pp.size)


class Decoder(nn.Module):
    """The stage's layers keep their checkpoint index (`layers.{i}`); the other stages'
    places hold an Identity. The embedding lives on the first stage, the final norm on the
    last."""

    def __init__(
        self, cfg: ModelConfig, groups: ParallelGroups, layer_type: type[DecoderLayer]
    ) -> None:
        super().__init__()
        pp, tp = groups.pp, groups.tp
        self.local = stage_layers(cfg.num_layers, pp)
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if pp.rank == 0 else None
        )
        self.layers = nn.ModuleList(
            layer_type(cfg, i - self.local.start, groups, i) if i in self.local else nn.Identity()
            for i in range(cfg.num_layers)
        )
        last = pp.rank == pp.size - 1
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if last else None


class CausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `logits` projects them.

    Under tensor parallelism (`tp.size > 1`) `cfg` is this rank's share
    (`ModelConfig.tensor_parallel_shard`): q/k/v and gate/up are column-parallel (each rank
    computes its heads and MLP columns, no communication), o_proj and down_proj row-parallel
    (an all-reduce each), the embedding and LM head split by vocabulary rows (an all-reduce
    after the lookup, an all-gather of the logits).

    Under pipeline parallelism (`pp.size > 1`) the model is one stage: its layers, the
    embedding on the first stage, the final norm and LM head on the last; `forward` takes the
    previous stage's hidden states and returns its own (the executor passes them on)."""

    layer_type: type[DecoderLayer] = DecoderLayer
    """The decoder layers' class (DeepSeek's model gives its own)."""
    attention_kind: ClassVar[AttentionKind] = gqa
    """The kind its layers' attention is (`kv/kinds/`): the executor builds its KV from it."""
    compiles: ClassVar[bool] = True
    """Whether `forward` runs its decoder layers through `run_layer` (compiled), which the run
    plan then compiles unless --enforce-eager."""
    inv_freq: torch.Tensor
    """RoPE's inverse frequencies (a buffer, not in the checkpoint)."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups | None = None) -> None:
        super().__init__()
        groups = groups or ParallelGroups()
        self.cfg, self.groups, self.tp = cfg, groups, groups.tp
        self.model = Decoder(cfg, groups, self.layer_type)
        self.first_stage = groups.pp.rank == 0
        self.last_stage = groups.pp.rank == groups.pp.size - 1
        self.local_layers = self.model.local
        """The checkpoint indices of this stage's layers."""
        self.num_local_layers = len(self.local_layers)
        self.kv_layers = self.local_layers
        """The layers the KV store keeps entries of: this stage's, and after them the
        multi-token prediction layer's where it drafts (`engine/worker.py`)."""
        self.lm_head: Linear | None = None
        if self.last_stage:
            shard = -(-cfg.vocab_size // groups.tp.size)
            self.lm_head = Linear(cfg.hidden_size, shard, bias=False)
            self.lm_head.exact_int8 = True  # the logits: 8 bits both under w8a8
            self.lm_head.float_out = True
            if cfg.tie_word_embeddings and self.model.embed_tokens is not None:
                self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", torch.tensor(cfg.rope_inv_freq), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVAttention,
        hidden: torch.Tensor | None = None,
        run_layer: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] (a flat batch); hidden: the previous pipeline stage's
        output (None on the first stage); run_layer(layer, hidden, cos, sin, kv): how each
        decoder layer runs (a compiled layer; None calls it). Returns hidden states
        [T, hidden] (normed on the last stage)."""
        first = cast(DecoderLayer, self.model.layers[self.model.local.start])
        rope = self.layer_rope(positions, first.input_layernorm.weight.dtype)
        if self.model.embed_tokens is not None:
            # the residual stream stays in float32 whatever the weights' dtype
            hidden = self.embed(input_ids).float()
        assert hidden is not None
        for i in self.model.local:
            layer = self.model.layers[i]
            cos, sin = rope(i)
            hidden = (
                layer(hidden, cos, sin, kv)
                if run_layer is None
                else run_layer(layer, hidden, cos, sin, kv)
            )
        return hidden if self.model.norm is None else self.model.norm(hidden)

    def stage_output_shape(self, tokens: int) -> tuple[int, ...]:
        """What a pipeline stage that is not the last sends on for `tokens` tokens (float32):
        its hidden states."""
        return (tokens, self.cfg.hidden_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first stage's embeddings of the tokens (a model may scale them)."""
        assert self.model.embed_tokens is not None
        return self.model.embed_tokens(input_ids)

    def layer_rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin of the positions for layer i (the same for every layer here; a model whose
        layers differ gives its own)."""
        cos_sin = rope_cos_sin(positions, self.inv_freq, self.cfg.rope_scaling, dtype)
        return lambda i: cos_sin

    @property
    def held_experts(self) -> list[int]:
        """The routed experts this rank holds (every MoE layer holds the same); [] if dense."""
        for module in self.modules():
            if isinstance(module, RoutedExperts):
                return list(module.held)
        return []

    def join_expert_exchange(self) -> None:
        """DP attention + EP, a replica with no tokens this step: join every MoE layer's
        token exchange in layer order, as a forward would (its experts compute the other
        replicas' tokens); no attention, no KV page touched."""
        for module in self.model.modules():  # in layer order
            if isinstance(module, RoutedExperts):
                module.join_idle()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the given hidden states [N, hidden] (last stage)."""
        assert self.lm_head is not None
        logits = self.lm_head(hidden).float()
        if self.tp.size == 1:
            return logits
        return tp_all_gather(logits)[:, : self.cfg.vocab_size]
