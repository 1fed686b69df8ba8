"""The KV stores an executor runs over, built from its model's attention kind and the cache
config: one `PagedKVStore` of the kind's pages (`build_kv_store`), or for a kind with a
window two of them in a `WindowedKVStore` (`build_windowed_store`); under TP/PP each rank's
share with its tiers mirrored (`parallel_cpu_tier`, `parallel_ssd_pages`)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import cast

import torch

from pypto_serving.config import CacheConfig
from pypto_serving.errors import PyptoError
from pypto_serving.kv.disk_tier import HEADER_BYTES
from pypto_serving.kv.kinds import WindowedKind
from pypto_serving.kv.mirror import Journal
from pypto_serving.kv.mooncake_pool import join
from pypto_serving.kv.paged_cache import PagedCache
from pypto_serving.kv.spec import KVSpec
from pypto_serving.kv.store import PagedKVStore
from pypto_serving.kv.windowed_store import WindowedKVStore
from pypto_serving.models.llama import CausalLM

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
) -> PagedKVStore | WindowedKVStore:
    """The attention operator's KV (the spec of the model's attention kind, from its config)
    and the store of its pages, with tiers sized from the cache
    config's byte budgets (a kind that keeps rows for a window: `build_windowed_store`, its
    rows sized for `running` = (max_num_seqs, max_num_batched_tokens)). Under tensor
    parallelism it holds this rank's KV heads, under
    pipeline parallelism its stage's layers, with the same page ids on every rank (the page
    count depends only on the config); its CPU and SSD tiers mirror rank 0's (`kv/mirror.py`),
    each rank's SSD pages in `<kv_ssd_dir>/rank<r>`."""
    if isinstance(model.attention_kind, WindowedKind):
        return build_windowed_store(model, device, dtype, cache, max_tokens_in_use, digest, running)
    spec = model.attention_kind.kv_spec(
        model.cfg, model.num_local_layers, cache.page_size, dtype, cache.kv_cache_dtype
    )
    store = build_paged_store(spec, model, device, cache, max_tokens_in_use, digest)
    if describe:
        log.info(store.describe())
    return store


def build_paged_store(
    spec: KVSpec,
    model: CausalLM,
    device: torch.device,
    cache: CacheConfig,
    max_tokens_in_use: int,
    digest: str,
    num_pages: int | None = None,
    budgets: tuple[int, int] | None = None,
    ssd_folder: str | None = None,
) -> PagedKVStore:
    """The store of `spec`'s pages (`num_pages`, or as the cache config says), its tiers
    sized from the config's byte budgets or `budgets` (CPU, SSD), its SSD pages in
    `ssd_folder` under kv_ssd_dir if given."""
    cpu_bytes, ssd_bytes = budgets or (cache.kv_cpu_bytes, cache.kv_ssd_bytes)
    cpu_pages, journal = cpu_bytes // spec.page_bytes, None
    page_bytes, g = spec.page_bytes, model.groups
    if num_pages is None:
        num_pages = num_pages_for(cache, page_bytes, -(-max_tokens_in_use // cache.page_size))
    ssd_dir = Path(cache.kv_ssd_dir).expanduser() if cache.kv_ssd_dir else None
    if ssd_dir is not None and ssd_folder is not None:
        ssd_dir = ssd_dir / ssd_folder
    ssd_pages = ssd_bytes // (page_bytes + HEADER_BYTES)
    if g.world_size > 1:
        cpu_pages, journal = parallel_cpu_tier(model, spec, cache.kv_cpu_bytes)
        if ssd_dir is not None:  # each rank its share, in its own folder (MLA: rank 0's)
            ssd_pages, keeps = parallel_ssd_pages(model, spec, cache.kv_ssd_bytes)
            ssd_dir = ssd_dir / f"rank{g.rank}" if keeps else None
            journal = Journal() if g.rank == 0 else None
    remote = None
    if cache.kv_remote is not None:  # one rank per engine (EngineConfig.validate)
        remote = join(cache.kv_remote, cache.kv_remote_bytes)
    if ssd_dir is not None and ssd_pages == 0:
        raise PyptoError(
            f"kv_ssd_bytes ({ssd_bytes}) is less than one page file "
            f"({page_bytes + HEADER_BYTES} bytes)"
        )
    try:
        store = PagedKVStore(
            PagedCache(spec, num_pages, device),
            cache.enable_prefix_caching,
            cpu_pages=cpu_pages,
            ssd_dir=ssd_dir,
            ssd_pages=ssd_pages,
            digest=digest,
            journal=journal,
            follows=g.rank > 0,
            remote=remote,
            remote_pages=cache.kv_remote_bytes // page_bytes,
        )
    except OSError as e:
        raise PyptoError(f"cannot use kv_ssd_dir {ssd_dir}: {e}") from None
    return store


def build_windowed_store(
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    cache: CacheConfig,
    max_tokens_in_use: int,
    digest: str,
    running: tuple[int, int],
) -> WindowedKVStore:
    """A windowed kind's two stores: its rows, enough pages for every running sequence's
    window plus a chunk of new tokens each (`max_num_seqs` x (keep + chunk)), and its
    whole pages, from what is left of the device budget (or `num_kv_pages` of them); the
    CPU and SSD budgets split in proportion to page bytes. running: (max_num_seqs,
    max_num_batched_tokens)."""
    kind = cast(WindowedKind, model.attention_kind)
    layers, page = model.num_local_layers, cache.page_size
    rows_spec, keep = kind.row_spec(model.cfg, layers, page, dtype, cache.kv_cache_dtype)
    pages_spec = kind.kv_spec(model.cfg, layers, page, dtype, cache.kv_cache_dtype)
    seqs, chunk = running
    row_pages = seqs * (-(-keep // page) + 2) + -(-chunk // page)
    rows_bytes = row_pages * rows_spec.page_bytes
    if cache.num_kv_pages:
        pages = cache.num_kv_pages
    else:
        if cache.kv_device_bytes <= rows_bytes:
            raise PyptoError(
                f"kv_device_bytes ({cache.kv_device_bytes}) is less than this model's window "
                f"rows need ({rows_bytes} bytes for {seqs} sequences)",
                "kv_device_bytes",
            )
        budget = replace(cache, kv_device_bytes=cache.kv_device_bytes - rows_bytes)
        pages = num_pages_for(budget, pages_spec.page_bytes, -(-max_tokens_in_use // page))
    share = rows_spec.page_bytes / (rows_spec.page_bytes + pages_spec.page_bytes)
    cpu, ssd = cache.kv_cpu_bytes, cache.kv_ssd_bytes
    rows_budget = (int(cpu * share), int(ssd * share))
    pages_budget = (cpu - rows_budget[0], ssd - rows_budget[1])
    args = (model, device, cache, max_tokens_in_use, digest)
    rows = build_paged_store(rows_spec, *args, row_pages, rows_budget, "rows")
    whole = build_paged_store(pages_spec, *args, pages, pages_budget, "pages")
    store = WindowedKVStore(rows, whole, keep)
    log.info(store.describe())
    return store


def parallel_cpu_tier(model: CausalLM, spec: KVSpec, budget: int) -> tuple[int, Journal | None]:
    """Under TP/PP: this rank's CPU-tier pages, the same count on every rank (the byte budget
    over one page of the whole engine, every rank's share together; a KV the same on every TP
    rank, MLA's latent, is counted and kept once, by rank 0), and rank 0's journal of the page
    moves the other ranks mirror."""
    g, same = model.groups, spec.same_on_tp_ranks
    heads = spec.num_heads * (1 if same else g.tp.size)
    whole = replace(spec, num_layers=model.cfg.num_layers, num_heads=heads)
    pages = budget // whole.page_bytes if not (same and g.tp.rank > 0) else 0
    return pages, Journal() if g.rank == 0 and pages > 0 else None


def parallel_ssd_pages(model: CausalLM, spec: KVSpec, budget: int) -> tuple[int, bool]:
    """Under TP/PP: this rank's SSD-tier pages, the same count on every rank keeping one
    (the byte budget over one page of the whole engine and every rank's file header; MLA's
    latent is kept once per stage, by its TP rank 0), and whether this rank keeps one."""
    g, same = model.groups, spec.same_on_tp_ranks
    heads = spec.num_heads * (1 if same else g.tp.size)
    whole = replace(spec, num_layers=model.cfg.num_layers, num_heads=heads)
    files = g.world_size // (g.tp.size if same else 1)
    return budget // (whole.page_bytes + files * HEADER_BYTES), not (same and g.tp.rank > 0)
