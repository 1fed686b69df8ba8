"""A rank's start-up, spelled once for every rank of an engine: join the group, load this
rank's share of the model and build its executor, all as its `RunPlan` says.

Rank 0 (`EngineCore`) then also holds the scheduler and warms the executor up; ranks >= 1
(`engine/ranks.py`) follow its steps.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from pypto_serving import native
from pypto_serving.config import EngineConfig, ParallelConfig
from pypto_serving.distributed import Group, ParallelGroups, init_distributed, resolve_groups
from pypto_serving.engine.plan import AttentionPlan, RunPlan, plan_attention, plan_run
from pypto_serving.errors import PyptoError
from pypto_serving.executor.draft_model import DraftModel
from pypto_serving.executor.mtp import MTPDrafter
from pypto_serving.executor.paged import PagedExecutor, build_paged_executor
from pypto_serving.executor.reference import ReferenceExecutor
from pypto_serving.models.config import ModelConfig, load_model_config
from pypto_serving.models.default_model import resolve_model_path
from pypto_serving.models.llama import CausalLM
from pypto_serving.models.loader import load_model, load_mtp

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Share:
    """What a rank runs: its share of the model and the executor over it."""

    model: CausalLM
    executor: PagedExecutor | ReferenceExecutor
    attention: AttentionPlan
    """How it attends and steps (its decodes of a few through the native step or not)."""


def join_group(
    config: EngineConfig, rank: int, backend: str, timeout_s: float, dp: Group | None = None
) -> ParallelGroups:
    """Join the engine's torch.distributed group (within `timeout_s`) as `rank` of replica
    `dp`; this rank's place in each of its groups (TP, PP, DP, EP). Under DP attention + EP
    the world is every replica's ranks: this rank joins as dp.rank * TP + rank of
    dp.size * TP."""
    p, dp = config.parallel, dp or Group()
    if p.expert_parallel_over_dp:  # one world: every replica's ranks, replica-major
        tp = p.tensor_parallel_size
        init_distributed(dp.rank * tp + rank, dp.size * tp, backend, timeout_s, tp, tp)
    else:
        init_distributed(rank, p.ranks_per_engine, backend, timeout_s, p.tensor_parallel_size)
    return resolve_groups(
        rank,
        p.tensor_parallel_size,
        p.pipeline_parallel_size,
        p.enable_expert_parallel,
        p.expert_placement_strategy,
        dp,
        p.all2all_exchange,
    )


def load_share(
    config: EngineConfig, plan: RunPlan, model_dir: Path, groups: ParallelGroups
) -> Share:
    """This rank's share of the model (its heads, its stage's layers, its experts) and its
    executor, attending as `plan_attention` decides (its native kernels built while the
    weights load): every rank builds the same paged executor, so page counts agree. Where
    the config drafts with DeepSeek's MTP layer, the layer loads beside rank 0's share
    (whole: under TP rank 0 drafts alone), its entries a KV layer after the model's on every
    rank (the pages agree; MLA's latent is the same on every TP rank), and the executor hands
    it its steps."""
    attention = plan_attention(plan, config, load_model_config(model_dir), groups)
    if attention.kernels is not None:
        _build_kernels_soon(attention.kernels)
    model = _load_planned(model_dir, plan, groups, attention)
    if config.executor == "reference":
        return Share(model, ReferenceExecutor(model, plan.device), attention)
    spec = config.speculation()
    mtp = None
    if spec is not None and spec.method == "mtp":  # its entries: a layer after the target's
        if groups.rank == 0:  # (under TP and PP rank 0 drafts alone, the layer whole)
            try:
                mtp = load_mtp(model_dir, model, plan.dtype)
            except PyptoError as e:
                raise PyptoError(f"speculative_config: {e}", "speculative_config") from e
        model.kv_layers = range(model.local_layers.start, model.local_layers.stop + 1)
    executor = build_paged_executor(
        config, model, plan.device, plan.dtype, plan.quantization, attention, model_dir
    )
    if spec is not None and spec.method == "mtp":
        executor.keeps_hidden = True  # (under PP the last stage sends them to rank 0)
        if mtp is not None:
            executor.mtp = MTPDrafter(mtp, spec.num_speculative_tokens)
    return Share(model, executor, attention)


def load_draft_model(config: EngineConfig, target: ModelConfig, max_model_len: int) -> DraftModel:
    """Speculative decoding's draft model (the config's `speculative_config` names it), on
    rank 0 alone, whole: planned as the engine's own config would plan it on one rank (its
    device, dtype, threads; the spec's quantization), a pool of its own (no prefix cache, no
    tiers: its pages are taken back as its drafts are rejected), its layers run eagerly, its
    decodes through the native step where the plan runs one. Its vocabulary must fit the
    target's."""
    spec = config.speculation()
    assert spec is not None and spec.model is not None
    param = "speculative_config"
    try:
        path = resolve_model_path(spec.model)
        cfg = load_model_config(path)
    except PyptoError as e:
        raise PyptoError(f"speculative_config: the draft model: {e}", param) from e
    if cfg.vocab_size > target.vocab_size:
        raise PyptoError(
            f"speculative_config: the draft model's vocabulary ({cfg.vocab_size} tokens) is "
            f"larger than the target's ({target.vocab_size}): a draft model shares the "
            "target's tokenizer",
            param,
        )
    cache = replace(
        config.cache,
        enable_prefix_caching=False,
        kv_cpu_bytes=0,
        kv_ssd_dir=None,
        kv_remote=None,
        kv_events_endpoint=None,
        kv_events_replay_endpoint=None,
    )
    own = replace(
        config,
        parallel=ParallelConfig(),
        cache=cache,
        max_model_len=max_model_len,
        quantization=spec.quantization,
    )
    plan = plan_run(own, path)
    groups = ParallelGroups()
    attention = replace(plan_attention(plan, own, cfg, groups), compiled=False)
    model = _load_planned(path, plan, groups, attention)
    if not model.attention_kind.SPECULATES:
        raise PyptoError(
            f"speculative_config: the draft model's attention ({model.attention_kind.NAME}) "
            "keeps state built from each token it writes, which its rejected drafts could "
            "not be taken back from",
            param,
        )
    executor = build_paged_executor(
        own, model, plan.device, plan.dtype, plan.quantization, attention, path
    )
    limit = min(max_model_len, cfg.max_position_embeddings, executor.kv.capacity_tokens)
    log.info(
        "draft model: %s (%s layers), proposing up to %d tokens",
        cfg.architecture,
        cfg.num_layers,
        spec.num_speculative_tokens,
    )
    return DraftModel(executor, limit)


def _load_planned(
    path: Path, plan: RunPlan, groups: ParallelGroups, attention: AttentionPlan
) -> CausalLM:
    """The model at `path` (this rank's share) loaded as its run and attention plans say."""
    return load_model(
        path,
        plan.dtype,
        plan.device,
        groups,
        plan.quantization,
        attention.native_decode,
        plan.pack_linear,
        records_only=plan.records_only,
        records_wide=plan.records_wide,
        expert_records=plan.expert_records,
    )


def _build_kernels_soon(shape: tuple[int, int]) -> None:
    """Build (or load) the native attention kernels in a background thread while the model
    loads: ~5 s of g++ on a cold start, overlapping the loading's single-threaded part. The
    executor's own call waits for it (`native.library` takes a lock); a failure is met there
    again, and said."""

    def build() -> None:
        try:
            native.library(*shape)
        except Exception:
            log.debug("building the attention kernels ahead failed", exc_info=True)

    threading.Thread(target=build, name="pypto-attention", daemon=True).start()
