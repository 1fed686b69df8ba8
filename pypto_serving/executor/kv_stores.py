"""The KV an executor runs over, built from its model's attention kind and the cache config:
a manager and a pool per KV group the kind declares (`build_kv_store`), under TP/PP each
rank's share with its tiers mirrored (`parallel_cpu_tier`, `parallel_ssd_pages`)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from pypto_serving.config import CacheConfig
from pypto_serving.distributed import Group
from pypto_serving.errors import PyptoError
from pypto_serving.kv.disk_tier import HEADER_BYTES
from pypto_serving.kv.groups import KVGroups
from pypto_serving.kv.manager import KVManager
from pypto_serving.kv.mirror import Journal
from pypto_serving.kv.mooncake_pool import join
from pypto_serving.kv.paged_cache import PagedCache
from pypto_serving.kv.pool import KVPool
from pypto_serving.kv.spec import KVGroup, KVSpec
from pypto_serving.models.llama import CausalLM, stage_layers

log = logging.getLogger(__name__)


def num_pages_for(cache: CacheConfig, page_bytes: int, max_pages_in_use: int) -> int:
    """Device pages to allocate: num_kv_pages if given, else the byte budget, but never more
    than all running sequences at their longest could hold at once."""
    if cache.num_kv_pages:
        return cache.num_kv_pages
    return max(min(cache.kv_device_bytes // page_bytes, max_pages_in_use), 1)


def build_kv_store(
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    cache: CacheConfig,
    max_tokens_in_use: int,
    digest: str,
    describe: bool = True,
    running: tuple[int, int] = (1, 1),
) -> KVGroups:
    """The attention operator's KV: a pool and a manager for each group the model's attention
    kind declares, from its config. A group that keeps a window gets enough device pages for
    every running sequence's window plus a chunk of new tokens each (`running` =
    (max_num_seqs, max_num_batched_tokens)); the groups of full attention share what is left
    of the device budget (`num_kv_pages` each, if given), the same page count each. The CPU
    and SSD budgets split over the groups in proportion to their page bytes. Under tensor
    parallelism it holds this rank's KV heads, under pipeline parallelism its stage's layers,
    with the same page ids on every rank: the page counts depend only on the config, each
    group's sized by its largest page over the pipeline stages (so no stage exceeds the
    budget); its CPU and SSD tiers mirror rank 0's (`kv/mirror.py`), each rank's SSD pages in
    `<kv_ssd_dir>/rank<r>`."""
    kind, cfg, page = model.attention_kind, model.cfg, cache.page_size
    kv_dtype = cache.kv_cache_dtype
    groups = kind.kv_groups(cfg, model.kv_layers, page, dtype, kv_dtype)
    pp = model.groups.pp
    stages = [groups]  # every pipeline stage's groups
    if pp.size > 1:
        stages = [
            kind.kv_groups(
                cfg, stage_layers(cfg.num_layers, Group(s, pp.size)), page, dtype, kv_dtype
            )
            for s in range(pp.size)
        ]
    largest = {
        g.name: max(stage[i].spec.page_bytes for stage in stages) for i, g in enumerate(groups)
    }
    whole = groups  # each group in the whole model (under TP/PP: the tiers hold all ranks')
    if model.groups.world_size > 1:
        whole = kind.kv_groups(cfg, range(cfg.num_layers), page, dtype, kv_dtype)
    seqs, chunk = running
    pages: dict[str, int] = {}
    for g in groups:
        if g.keep is not None:
            pages[g.name] = seqs * (-(-g.keep // page) + 2) + -(-chunk // page)
    window_bytes = sum(pages[g.name] * largest[g.name] for g in groups if g.name in pages)
    full = [g for g in groups if g.keep is None]
    if full and cache.num_kv_pages:
        pages |= dict.fromkeys((g.name for g in full), cache.num_kv_pages)
    elif full:
        if window_bytes and cache.kv_device_bytes <= window_bytes:
            raise PyptoError(
                f"kv_device_bytes ({cache.kv_device_bytes}) is less than this model's window "
                f"rows need ({window_bytes} bytes for {seqs} sequences)",
                "kv_device_bytes",
            )
        budget = replace(cache, kv_device_bytes=cache.kv_device_bytes - window_bytes)
        page_bytes = sum(largest[g.name] for g in full)
        n = num_pages_for(budget, page_bytes, -(-max_tokens_in_use // page))
        pages |= dict.fromkeys((g.name for g in full), n)
    # the CPU and SSD budgets split by the whole model's page bytes: the same on every rank
    total = sum(g.spec.page_bytes for g in whole)
    cpu, ssd = cache.kv_cpu_bytes, cache.kv_ssd_bytes
    budgets = {
        g.name: (cpu * g.spec.page_bytes // total, ssd * g.spec.page_bytes // total)
        for g in whole[1:]
    }
    budgets[whole[0].name] = (
        cpu - sum(b[0] for b in budgets.values()),
        ssd - sum(b[1] for b in budgets.values()),
    )
    several = len(groups) > 1  # each group's SSD pages in a folder of its name
    whole_specs = {g.name: g.spec for g in whole}
    managers = [
        KVManager(
            g.name,
            build_pool(
                g,
                model,
                device,
                cache,
                digest,
                pages[g.name],
                budgets[g.name],
                whole_specs[g.name],
                g.name if several else None,
            ),
            g.keep,
        )
        for g in groups
    ]
    kv = KVGroups(managers)
    if describe:
        log.info(kv.describe())
    return kv


def build_pool(
    group: KVGroup,
    model: CausalLM,
    device: torch.device,
    cache: CacheConfig,
    digest: str,
    num_pages: int,
    budgets: tuple[int, int],
    whole: KVSpec,
    ssd_folder: str | None,
) -> KVPool:
    """The pool of a group's pages: `num_pages` on the device, its tiers sized from
    `budgets` (CPU, SSD bytes; under TP/PP over a page of the `whole` group, every layer's,
    and every rank's heads), its SSD pages in `ssd_folder` under kv_ssd_dir if given."""
    spec = group.spec
    cpu_bytes, ssd_bytes = budgets
    page_bytes, g, journal = spec.page_bytes, model.groups, None
    cpu_pages = cpu_bytes // page_bytes if page_bytes else 0  # 0: a stage without its layers
    ssd_dir = Path(cache.kv_ssd_dir).expanduser() if cache.kv_ssd_dir else None
    if ssd_dir is not None and ssd_folder is not None:
        ssd_dir = ssd_dir / ssd_folder
    ssd_pages = ssd_bytes // (page_bytes + HEADER_BYTES)
    if g.world_size > 1:
        cpu_pages, journal = parallel_cpu_tier(model, whole, cpu_bytes)
        if ssd_dir is not None:  # each rank its share, in its own folder (MLA: rank 0's)
            ssd_pages, keeps = parallel_ssd_pages(model, whole, ssd_bytes)
            ssd_dir = ssd_dir / f"rank{g.rank}" if keeps else None
    remote = None
    if cache.kv_remote is not None:  # one rank per engine (EngineConfig.validate)
        remote = join(cache.kv_remote, cache.kv_remote_bytes)
    if ssd_dir is not None and ssd_pages == 0:
        raise PyptoError(
            f"kv_ssd_bytes ({ssd_bytes}) is less than one page file "
            f"({page_bytes + HEADER_BYTES} bytes)"
        )
    try:
        return KVPool(
            PagedCache(spec, num_pages, device),
            cache.enable_prefix_caching,
            cpu_pages=cpu_pages,
            ssd_dir=ssd_dir,
            ssd_pages=ssd_pages,
            digest=digest,
            journal=journal,
            follows=g.rank > 0,
            remote=remote,
            remote_pages=cache.kv_remote_bytes // page_bytes if page_bytes else 0,
        )
    except OSError as e:
        raise PyptoError(f"cannot use kv_ssd_dir {ssd_dir}: {e}") from None


def every_rank(model: CausalLM, whole: KVSpec) -> KVSpec:
    """A group's spec over the whole model's layers (`whole`, this rank's heads) widened to
    every TP rank's heads, but for a KV the same on every TP rank (counted once)."""
    if whole.same_on_tp_ranks:
        return whole
    return replace(whole, num_heads=whole.num_heads * model.groups.tp.size)


def parallel_cpu_tier(model: CausalLM, whole: KVSpec, budget: int) -> tuple[int, Journal | None]:
    """Under TP/PP: this rank's CPU-tier pages of a group (`whole`: its spec over the whole
    model's layers), the same count on every rank (the byte budget over one page of the whole
    engine, every rank's share together; a KV the same on every TP rank, MLA's latent, is
    counted and kept once, by rank 0), and rank 0's journal of the page moves the other ranks
    mirror (kept without a CPU tier too: pages another server sent are written by it)."""
    g, same = model.groups, whole.same_on_tp_ranks
    page_bytes = every_rank(model, whole).page_bytes
    pages = budget // page_bytes if not (same and g.tp.rank > 0) else 0
    return pages, Journal() if g.rank == 0 else None  # (also for handoffs' pages)


def parallel_ssd_pages(model: CausalLM, whole: KVSpec, budget: int) -> tuple[int, bool]:
    """Under TP/PP: this rank's SSD-tier pages of a group (`whole`: its spec over the whole
    model's layers), the same count on every rank keeping one (the byte budget over one page
    of the whole engine and every rank's file header; MLA's latent is kept once per stage, by
    its TP rank 0), and whether this rank keeps one."""
    g, same = model.groups, whole.same_on_tp_ranks
    files = g.world_size // (g.tp.size if same else 1)
    page_bytes = every_rank(model, whole).page_bytes
    return budget // (page_bytes + files * HEADER_BYTES), not (same and g.tp.rank > 0)
