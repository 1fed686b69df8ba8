"""Prefill and decode on separate servers (engine/kv_transfer.py, kv/handoff.py,
server/router.py): a request a prefill server began and a decode server finished gives the
tokens one server gives alone (every attention kind's pages travel: GQA, MLA's latent,
DeepSeek-V4's groups, windows, local/global hybrids), seeded sampling and grammars included;
the KV moves over Mooncake's Transfer Engine only between servers of one layout and one
prompt, is freed once read, and a prefill or decode server that goes away costs a request
nothing but time (the decode server computes the prompt) or fails it clearly (a 503)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from live_server import free_port, serving, tiny_llm
from mooncake_master import mooncake_master
from patience import patience

from pypto_serving import SamplingParams
from pypto_serving.engine.kv_transfer import KVTransfer, TransferFailed
from pypto_serving.engine.llm import LLM, child_id
from pypto_serving.kv.handoff import (
    GroupKV,
    Handoff,
    KVLayout,
    PageGeometry,
    counts,
    num_bytes,
    pack,
    unpack,
)
from pypto_serving.ops.sampler import Sampled
from pypto_serving.server.router import RouterConfig, build_router_app

KINDS = [
    "llama-gqa4-tied",  # GQA
    "deepseekv3-qlora-yarn",  # MLA: the latent
    "deepseekv4-swa-csa-hca-hash",  # V4: entries, rows, CSA's inputs
    "mistral-window8",  # a window: the pages it gave back stay behind
    "gemma3-local5-global",  # local and global layers: two groups
]
PROMPTS = [[(7 * i + 3 * j) % 200 + 5 for j in range(n)] for i, n in enumerate((5, 19, 40, 71))]
"""Lengths inside a page, across pages, and longer than the windows."""
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PREFILL = {"do_remote_decode": True}


def handed_over(prefill: LLM, decode: LLM, prompt: list[int], params: SamplingParams) -> Handoff:
    """The prefill engine's handoff for `prompt`, through a byte buffer cut by the decode
    engine's geometry (what the Transfer Engine carries)."""
    family = prefill.add(prompt, params, export_kv=True)
    while prefill.engine.has_unfinished():
        prefill.step()
    handoff = family.children[0].handoff
    assert handoff is not None and family.children[0].finish_reason == "length"
    layout = decode.engine.kv_layout()
    geometry = layout.geometry
    assert prefill.engine.kv_layout().digest == layout.digest
    buffer = np.zeros(num_bytes(counts(handoff.groups), geometry), dtype=np.uint8)
    pack(handoff.groups, buffer)
    groups = unpack(buffer, counts(handoff.groups), geometry)
    return Handoff(groups, handoff.first, handoff.generator_state)


def decoded(
    decode: LLM,
    prompts: list[list[int]],
    handoffs: list[Handoff],
    params: Any,
    reserve: tuple[int, ...] = (),
) -> list:
    """The decode engine going on from the handoffs, all together; those numbered in
    `reserve` get their device pages reserved first (as a decode server does before it
    reads) and are admitted into exactly those pages."""
    kv = decode.engine.executor.kv
    reserved: dict[str, dict[str, list[int]]] = {}
    for i in reserve:
        rid = child_id(f"r{i}", 0)
        free = [m.pool.num_free for m in kv.managers]
        assert decode.engine.reserve(rid, [len(g.pages) for g in handoffs[i].groups])
        reserved[rid] = {m.name: list(m.reserved[rid]) for m in kv.managers}
        taken = [len(reserved[rid][m.name]) for m in kv.managers]
        assert [f - m.pool.num_free for f, m in zip(free, kv.managers, strict=True)] == taken
    families = [
        decode.add(p, params, handoff=h, request_id=f"r{i}")
        for i, (p, h) in enumerate(zip(prompts, handoffs, strict=True))
    ]
    decode.step()  # every request admitted (swapped in) and decoded once
    for rid, pages in reserved.items():
        for m in kv.managers:
            table = m.tables[rid]
            held = table.pages[table.released : table.released + len(pages[m.name])]
            if m.keep is None:  # (a window may have given its first pages back already)
                assert held == pages[m.name], (m.name, held, pages[m.name])
            assert rid not in m.reserved
    while decode.engine.has_unfinished():
        decode.step()
    assert all(not m.reserved for m in kv.managers)
    for f, p in zip(families, prompts, strict=True):  # the prompt's KV: handed over, as cached
        out = f.output()
        if len(out.outputs[0].token_ids) > 1:  # (one ended by its first token is never admitted)
            assert out.num_cached_tokens == len(p)
            assert out.cached_tokens_by_tier == {"handoff": len(p)}
    return [f.output().outputs[0] for f in families]


@pytest.mark.parametrize("name", KINDS)
def test_a_handoff_goes_on_as_one_server_would(tiny_model, name: str) -> None:
    path = tiny_model(name)
    with tiny_llm(path) as prefill, tiny_llm(path) as decode:
        alone = [o.outputs[0].token_ids for o in prefill.generate(PROMPTS, GREEDY, False)]
        handoffs = [handed_over(prefill, decode, p, GREEDY) for p in PROMPTS]
        got = decoded(decode, PROMPTS, handoffs, GREEDY, reserve=(1, 3))  # all four together
        assert [o.token_ids for o in got] == alone
        assert [h.first.token_id for h in handoffs] == [ids[0] for ids in alone]
        groups = handoffs[-1].groups
        if name.startswith("mistral"):  # the window's passed pages were not sent
            assert groups[0].released > 0
        stats = decode.engine.stats()
        assert stats.prompt_tokens == 0  # the decode engine computed no prompt token


@pytest.mark.parametrize(
    "name, knobs",
    [
        ("llama-gqa4-tied", {"tensor_parallel_size": 2, "kv_cpu_bytes": 1 << 20}),
        ("llama-gqa4-tied", {"pipeline_parallel_size": 2}),
        ("deepseekv3-qlora-yarn", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
        ("gemma3-local5-global", {"tensor_parallel_size": 2}),  # two groups
    ],
)
def test_a_handoff_between_parallel_servers_goes_on_as_one_server_would(
    tiny_model, name: str, knobs: dict[str, Any]
) -> None:
    """Under TP or PP every rank's share of the pages travels (rank 0's first, each rank's
    taken at export and handed to it at receive); the decode server writes them as it admits
    the requests (with a CPU tier: the journal's moves, replayed by every rank), forgets those
    of a request that went away first, and goes on as one server would."""
    path = tiny_model(name)
    scored = replace(GREEDY, logprobs=0)  # (a tiny model's tokens may not show a wrong share)
    with tiny_llm(path) as one:
        alone = [o.outputs[0] for o in one.generate(PROMPTS, scored, False)]
        single = one.engine.kv_layout()
    exported = []
    with tiny_llm(path, **knobs) as prefill:
        for prompt in [*PROMPTS, PROMPTS[2]]:
            family = prefill.add(prompt, scored, export_kv=True)
            while prefill.engine.has_unfinished():
                prefill.step()
            exported.append(family.children[0].handoff)
        layout = prefill.engine.kv_layout()
    assert layout.digest != single.digest  # a TP=1 server takes none of these handoffs
    first, second = layout.page_bytes  # each rank's bytes of a page of each group
    if name.startswith("deepseek"):  # the latent is the same on both TP ranks: sent once
        assert second == [0] * len(first)
    else:
        assert len(second) == len(first) and all(b > 0 for b in second)
    with tiny_llm(path, **knobs) as decode:
        assert decode.engine.kv_layout() == layout
        handoffs = []
        for h in exported:
            assert h is not None and h.buffer is not None
            groups, shares = layout.cut(h.buffer, counts(h.groups))
            assert len(shares) == 1 and shares[0].size == layout.share_sizes(counts(groups))[1]
            handoffs.append(Handoff(groups, h.first, h.generator_state, shares=shares))
        gone = decode.add(PROMPTS[2], scored, handoff=handoffs.pop(), request_id="gone")
        decode.abort(gone)  # its shares are forgotten on every rank, never written
        assert gone.children[0].finish_reason == "abort"
        got = decoded(decode, PROMPTS, handoffs, scored, reserve=(1, 3))
        assert decode.engine.stats().prompt_tokens == 0
        again = [o.outputs[0] for o in decode.generate(PROMPTS[:2], scored, False)]
    for mine, theirs in zip(got + again, alone + alone[:2], strict=True):  # (prefix hits)
        assert mine.token_ids == theirs.token_ids
        logprobs = [s.logprob for s in mine.logprobs]
        assert logprobs == pytest.approx([s.logprob for s in theirs.logprobs], abs=1e-4)


def test_a_reservation_takes_every_group_s_pages_or_none(tiny_model) -> None:
    """A decode server reserves a handoff's device pages before reading it: all groups'
    or, where the pool has not the room, none (it then reads into host memory)."""
    with tiny_llm(tiny_model("gemma3-local5-global"), num_kv_pages=6) as decode:
        kv = decode.engine.executor.kv
        free = [m.pool.num_free for m in kv.managers]  # (the two groups' pools differ)
        assert not decode.engine.reserve("a-0", [2, free[1] + 1])  # the second has not that
        assert [m.pool.num_free for m in kv.managers] == free and not kv.managers[0].reserved
        assert decode.engine.reserve("a-0", [2, free[1] - 1])
        assert [m.pool.num_free for m in kv.managers] == [free[0] - 2, 1]
        decode.engine.unreserve("a-0")
        assert [m.pool.num_free for m in kv.managers] == free


def test_sampling_logprobs_and_grammars_go_on_where_they_were(tiny_model) -> None:
    path = tiny_model("llama-gqa4-tied")
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=16, logprobs=2)
    grammar = SamplingParams(
        temperature=0.7, seed=5, max_tokens=24, structured_outputs={"regex": "[a-z]{3,9}-[0-9]{2}"}
    )
    with tiny_llm(path) as prefill, tiny_llm(path) as decode:
        for params in (sampled, grammar):
            alone = prefill.generate(PROMPTS[:2], params, False)
            handoffs = [handed_over(prefill, decode, p, params) for p in PROMPTS[:2]]
            assert all(h.generator_state is not None for h in handoffs)
            got = decoded(decode, PROMPTS[:2], handoffs, params)
            for a, b in zip(alone, got, strict=True):
                assert b.token_ids == a.outputs[0].token_ids
                assert b.text == a.outputs[0].text
                assert b.finish_reason == a.outputs[0].finish_reason
                if params.logprobs:
                    assert [s.logprob for s in b.logprobs] == pytest.approx(
                        [s.logprob for s in a.outputs[0].logprobs], abs=1e-5
                    )


def test_a_first_token_that_ends_the_request_ends_it_on_the_decode_server(tiny_model) -> None:
    path = tiny_model("llama-gqa4-tied")
    with tiny_llm(path) as prefill, tiny_llm(path) as decode:
        one = SamplingParams(temperature=0, max_tokens=1)
        handoff = handed_over(prefill, decode, PROMPTS[1], one)
        (out,) = decoded(decode, [PROMPTS[1]], [handoff], one)
        assert out.token_ids == [handoff.first.token_id] and out.finish_reason == "length"
        stop = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[handoff.first.token_id])
        (out,) = decoded(decode, [PROMPTS[1]], [handoff], stop)
        assert out.token_ids == [handoff.first.token_id] and out.finish_reason == "stop"
        assert not decode.engine.has_unfinished()


# --- the Transfer Engine's side ----------------------------------------------------------

GEOMETRY = [PageGeometry("gqa", ((2, 3, 4, 8), (2, 3, 4, 8)), torch.bfloat16)]
LAYOUT = KVLayout("layout", GEOMETRY, [[GEOMETRY[0].page_bytes]])


def some_handoff() -> Handoff:
    pages = [tuple(torch.randn(2, 3, 4, 8).bfloat16() for _ in range(2)) for _ in range(3)]
    return Handoff([GroupKV("gqa", 10, 0, pages)], Sampled(5, -0.5, {5: -0.5, 7: -1.0}), b"st")


def listening_sockets() -> set[str]:
    """This process's listening TCP sockets (local address:port, as /proc/net shows them;
    other processes', such as other test workers', left out by their inodes)."""
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                mine.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:
                found.add(fields[1])
    return found


def test_a_handoff_crosses_the_transfer_engine_once_and_is_freed() -> None:
    before = listening_sockets()
    prefill, decode = KVTransfer("prefill", "127.0.0.1"), KVTransfer("decode", "127.0.0.1")
    try:
        sent = some_handoff()
        params = prefill.offer(sent, "layout", [1, 2, 3])
        assert prefill.num_offers == 1
        got = decode.pull(params, LAYOUT, [1, 2, 3])
        pairs = zip(sent.groups[0].pages, got.groups[0].pages, strict=True)
        assert all(torch.equal(a, b) for p, q in pairs for a, b in zip(p, q, strict=True))
        assert got.first == sent.first and got.generator_state == b"st"
        prefill.sweep()  # read: freed
        assert prefill.num_offers == 0
        params = prefill.offer(sent, "layout", [1, 2, 3])
        with pytest.raises(TransferFailed, match="layout"):
            decode.pull(params, replace(LAYOUT, digest="another"), [1, 2, 3])
        with pytest.raises(TransferFailed, match="prompt"):
            decode.pull(params, LAYOUT, [1, 2, 4])
        wrong = [PageGeometry("gqa", ((2, 3, 4, 4), (2, 3, 4, 4)), torch.bfloat16)]
        with pytest.raises(TransferFailed, match="size"):
            decode.pull(params, KVLayout("layout", wrong, [[wrong[0].page_bytes]]), [1, 2, 3])
        with pytest.raises(TransferFailed, match="malformed"):
            decode.pull({"remote_host": "x"}, LAYOUT, [1, 2, 3])
        prefill.close()  # gone: the read fails at once, it does not hang
        start = time.monotonic()
        with pytest.raises(TransferFailed, match="failed"):
            decode.pull(params, LAYOUT, [1, 2, 3])
        assert time.monotonic() - start < patience(10)
        with pytest.raises(TransferFailed, match="closed"):
            prefill.offer(sent, "layout", [1, 2, 3])
    finally:
        prefill.close()
        decode.close()
    assert listening_sockets() <= before  # closed, the Transfer Engines listen no more


def test_an_offer_nobody_reads_is_freed_after_its_timeout() -> None:
    prefill = KVTransfer("prefill", "127.0.0.1", timeout_s=0.2)
    try:
        prefill.offer(some_handoff(), "layout", [1])
        assert prefill.num_offers == 1
        time.sleep(0.3)
        prefill.sweep()
        assert prefill.num_offers == 0
    finally:
        prefill.close()


def test_a_handoff_crosses_a_mooncake_store_once_and_is_removed() -> None:
    """The Store path: put by the prefill server, got once by the decode server (bit-exact)
    and removed; one nobody got removed after the timeout; servers that disagree on the
    path refuse clearly."""
    port = free_port()
    with mooncake_master(port, free_port()):
        url = f"mooncake://127.0.0.1:{port}"
        prefill = KVTransfer("prefill", timeout_s=0.5, store=url)
        decode = KVTransfer("decode", store=url)
        peer = KVTransfer("decode", "127.0.0.1")  # reads over the Transfer Engine
        try:
            sent = some_handoff()
            params = prefill.offer(sent, "layout", [1, 2, 3])
            assert params["store_key"].startswith("pypto-handoff/") and "buffer" not in params
            assert prefill.store.is_exist(params["store_key"]) == 1
            got = decode.pull(params, LAYOUT, [1, 2, 3])
            pairs = zip(sent.groups[0].pages, got.groups[0].pages, strict=True)
            assert all(torch.equal(a, b) for p, q in pairs for a, b in zip(p, q, strict=True))
            assert got.first == sent.first and got.generator_state == b"st"
            assert prefill.store.is_exist(params["store_key"]) != 1  # got, so removed
            assert decode.stats.pulled == 1 and decode.stats.pulled_bytes == params["num_bytes"]
            with pytest.raises(TransferFailed, match="Mooncake Store"):
                decode.pull(params, LAYOUT, [1, 2, 3])  # nothing there any more
            params = prefill.offer(sent, "layout", [1, 2, 3])
            with pytest.raises(TransferFailed, match="same --kv-transfer-store"):
                peer.pull(params, LAYOUT, [1, 2, 3])
            with pytest.raises(TransferFailed, match="malformed"):
                decode.pull(params | {"store_key": "elsewhere/x"}, LAYOUT, [1, 2, 3])
            time.sleep(0.6)  # nobody got it in time: the prefill server removes it
            prefill.sweep()
            assert prefill.num_offers == 0
            assert prefill.store.is_exist(params["store_key"]) != 1
            prefill.close()
            with pytest.raises(TransferFailed, match="closed"):
                prefill.offer(sent, "layout", [1, 2, 3])
        finally:
            for t in (prefill, decode, peer):
                t.close()


def test_the_router_serves_over_a_mooncake_store(tiny_model) -> None:
    """1P1D with the handoffs through a Mooncake Store: one engine's answers, the decode
    server computing no prompt."""
    path = tiny_model("llama-gqa4-tied")
    port = free_port()
    with mooncake_master(port, free_port()), contextlib.ExitStack() as stack:
        url = f"mooncake://127.0.0.1:{port}"
        sends, gets = KVTransfer("prefill", store=url), KVTransfer("decode", store=url)
        stack.callback(sends.close)
        stack.callback(gets.close)
        alone_llm, p_llm, d_llm = (stack.enter_context(tiny_llm(path)) for _ in range(3))
        alone = stack.enter_context(serving(alone_llm))
        p = stack.enter_context(serving(p_llm, transfer=sends))
        d = stack.enter_context(serving(d_llm, transfer=gets))
        router = stack.enter_context(routing([p.url], [d.url]))
        for stream in (False, True):
            want = asyncio.run(answers(alone.url, False, stream))
            assert asyncio.run(answers(router, False, stream)) == want, stream
        assert gets.stats.pulled == 2 * len(PROMPTS) and gets.stats.failed == 0
        assert d_llm.engine.stats().prompt_tokens == 0
        sends.sweep()
        assert sends.num_offers == 2 * len(PROMPTS)  # the prefill side cannot see them read
        assert all(sends.store.is_exist(k) != 1 for k in sends._stored)  # but they are gone


# --- servers and the router --------------------------------------------------------------


@contextmanager
def routing(prefill: list[str], decode: list[str], **knobs: Any) -> Iterator[str]:
    config = RouterConfig(prefill, decode, port=free_port(), retry_s=30, **knobs)
    server = uvicorn.Server(uvicorn.Config(build_router_app(config), port=config.port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + patience(30)
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the router did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=patience(30))


async def answers(url: str, chat: bool, stream: bool) -> list[str]:
    """Every prompt at once, greedy; each answer's text."""

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> str:
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 10, "temperature": 0}
        body |= {"ignore_eos": True, "stream": stream}
        if chat:
            words = " ".join(f"t{t}" for t in prompt)
            path, body = (
                "/v1/chat/completions",
                body | {"messages": [{"role": "user", "content": words}]},
            )
        else:
            path, body = "/v1/completions", body | {"prompt": prompt}
        if not stream:
            r = await client.post(url + path, json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"]["content"] if chat else choice["text"]
        text = ""
        async with client.stream("POST", url + path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        text += (c.get("delta") or {}).get("content") or c.get("text") or ""
        return text

    async with httpx.AsyncClient(timeout=patience(120)) as client:
        return list(await asyncio.gather(*(one(client, p) for p in PROMPTS)))


def test_vllm_s_proxy_protocol_drives_our_servers(tiny_model) -> None:
    """What vLLM's own proxy for its Mooncake and NIXL connectors sends, step by step: the
    request to a prefill server with `kv_transfer_params` whose other fields are null,
    `max_tokens` 1, no stream and no min_tokens; then the original request with the answer's
    `kv_transfer_params` to a decode server, streamed. The decode server's text is one
    server's, and it computed no prompt token."""
    path = tiny_model("llama-gqa4-tied")
    sends, gets = KVTransfer("prefill", "127.0.0.1"), KVTransfer("decode", "127.0.0.1")
    with contextlib.ExitStack() as stack:
        alone_llm, p_llm, d_llm = (stack.enter_context(tiny_llm(path)) for _ in range(3))
        alone = stack.enter_context(serving(alone_llm))
        p = stack.enter_context(serving(p_llm, transfer=sends))
        d = stack.enter_context(serving(d_llm, transfer=gets))
        want = asyncio.run(answers(alone.url, True, True))
        for prompt, text in zip(PROMPTS, want, strict=True):
            words = " ".join(f"t{t}" for t in prompt)
            original: dict[str, Any] = {"model": "tiny", "max_tokens": 10, "temperature": 0}
            original |= {"messages": [{"role": "user", "content": words}], "ignore_eos": True}
            original |= {"stream": True, "stream_options": {"include_usage": True}}
            original |= {"min_tokens": 2}
            ask = {k: v for k, v in original.items() if k not in ("stream_options", "min_tokens")}
            ask |= {"stream": False, "max_tokens": 1}
            ask["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
            ask["kv_transfer_params"] |= dict.fromkeys(
                ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
            )
            headers = {"Authorization": "Bearer None", "X-Request-Id": f"vllm-{len(words)}"}
            r = httpx.post(p.url + "/v1/chat/completions", json=ask, headers=headers)
            assert r.status_code == 200, r.text
            params = r.json()["kv_transfer_params"]
            assert params["do_remote_prefill"] and not params["do_remote_decode"]
            then = original | {"kv_transfer_params": params}
            got = ""
            with httpx.stream("POST", d.url + "/v1/chat/completions", json=then) as streamed:
                assert streamed.status_code == 200
                for line in streamed.iter_lines():
                    if line.startswith("data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            got += (c.get("delta") or {}).get("content") or ""
            assert got == text
        assert gets.stats.pulled == len(PROMPTS) and gets.stats.failed == 0
        assert d_llm.engine.stats().prompt_tokens == 0


def test_the_router_serves_prefill_and_decode_servers_as_one(tiny_model) -> None:
    path = tiny_model("llama-gqa4-tied")
    sends, gets = KVTransfer("prefill", "127.0.0.1"), KVTransfer("decode", "127.0.0.1")
    with contextlib.ExitStack() as stack:
        alone_llm, p_llm, d_llm = (stack.enter_context(tiny_llm(path)) for _ in range(3))
        alone = stack.enter_context(serving(alone_llm))
        prefill_side = stack.enter_context(contextlib.ExitStack())  # it stops first, below
        p = prefill_side.enter_context(serving(p_llm, transfer=sends))
        d = stack.enter_context(serving(d_llm, transfer=gets))
        router = stack.enter_context(routing([p.url], [d.url]))
        for chat in (False, True):
            for stream in (False, True):
                want = asyncio.run(answers(alone.url, chat, stream))
                assert asyncio.run(answers(router, chat, stream)) == want, (chat, stream)
        assert gets.stats.pulled == 4 * len(PROMPTS) and gets.stats.failed == 0
        sends.sweep()
        assert sends.num_offers == 0  # every handoff read, so freed
        assert d_llm.engine.stats().prompt_tokens == 0  # every prompt came from the prefill
        pulled = httpx.get(d.url + "/metrics").text  # the decode server's own counters
        n = 4 * len(PROMPTS)
        assert 'pypto_prompt_tokens_total{model_name="tiny"} 0.0' in pulled
        assert f'pypto_kv_transfer_pulls_total{{model_name="tiny",outcome="ok"}} {n}.0' in pulled
        assert f'pypto_kv_transfer_read_seconds_count{{model_name="tiny"}} {n}.0' in pulled
        assert 'pypto_kv_transfer_no_room_total{model_name="tiny"} 0.0' in pulled  # reserved
        assert all(not m.reserved for m in d_llm.engine.executor.kv.managers)
        counted = {
            line.split("{")[0]: float(line.split()[-1])
            for line in pulled.splitlines()
            if line.startswith("pypto_kv_transfer_pulled_")
        }
        (geometry,) = d_llm.engine.kv_layout().geometry  # one group of pages
        pages = counted["pypto_kv_transfer_pulled_pages_total"]
        assert pages >= 2 * sum(-(-len(prompt) // 16) for prompt in PROMPTS)  # completions'
        assert counted["pypto_kv_transfer_pulled_bytes_total"] == pages * geometry.page_bytes
        offered = httpx.get(p.url + "/metrics").text
        assert f'pypto_kv_transfer_offers_total{{model_name="tiny"}} {n}.0' in offered
        metrics = httpx.get(router + "/metrics").text
        assert 'pypto_router_requests_total{outcome="ok",role="prefill"' in metrics
        models = httpx.get(router + "/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        health = httpx.get(router + "/health")
        assert health.status_code == 200
        assert health.json()["servers"] == {p.url: "ok", d.url: "ok"}
        # a request asking a server for another role's work is told what to start
        body = {"prompt": [5, 6], "max_tokens": 2}
        r = httpx.post(d.url + "/v1/completions", json=body | {"kv_transfer_params": PREFILL})
        assert r.status_code == 400 and "--disaggregation-mode prefill" in r.text
        r = httpx.post(router + "/v1/completions", json=body | {"kv_transfer_params": {}})
        assert r.status_code == 400 and "router" in r.text
        # several prompts, or n > 1: the decode server alone answers them whole
        for extra in ({"prompt": [PROMPTS[0], PROMPTS[1]]}, {"prompt": "a b", "n": 2}):
            r = httpx.post(router + "/v1/completions", json=body | extra)
            assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        # a handoff that cannot be read (its prefill server gone after offering it): the
        # decode server computes the prompt itself
        body = {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        offered = httpx.post(p.url + "/v1/completions", json=body | {"kv_transfer_params": PREFILL})
        params = offered.json()["kv_transfer_params"]
        sends.close()
        again = httpx.post(p.url + "/v1/completions", json=body | {"kv_transfer_params": PREFILL})
        assert again.status_code == 200 and "kv_transfer_params" not in again.json()  # none
        r = httpx.post(d.url + "/v1/completions", json=body | {"kv_transfer_params": params})
        want = httpx.post(alone.url + "/v1/completions", json=body).json()["choices"][0]["text"]
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert gets.stats.failed == 1 and d_llm.engine.stats().prompt_tokens > 0
        # the prefill server stops: the router sends every request to the decode server
        prefill_side.close()
        want = asyncio.run(answers(alone.url, False, True))
        assert asyncio.run(answers(router, False, True)) == want
        metrics = httpx.get(router + "/metrics").text
        assert 'pypto_router_requests_total{outcome="failed",role="prefill"' in metrics
        assert "pypto_router_colocated_total 6.0" in metrics
        health = httpx.get(router + "/health")  # still serving: its decode server is up
        assert health.status_code == 200 and health.json()["servers"][p.url] == "down"
    with routing(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]) as router:  # nobody there
        r = httpx.post(router + "/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert r.status_code == 503 and "no decode server" in r.json()["error"]["message"]
        assert httpx.get(router + "/health").status_code == 503
        assert httpx.get(router + "/v1/models").status_code == 503
    gets.close()


def test_bad_disaggregation_options_are_refused_clearly() -> None:
    from pypto_serving.config import ServerConfig, TransferSpec
    from pypto_serving.errors import PyptoError
    from pypto_serving.server.launch import run_server

    cases = [
        ({"disaggregation_mode": "middle"}, "prefill, decode, both or null"),
        ({"kv_transfer_config": "not json"}, "not a JSON object"),
        ({"kv_transfer_config": '{"kv_role": "kv_nothing"}'}, "kv_role must be one of"),
        (
            {"kv_transfer_config": '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'},
            "Mooncake",
        ),
        (
            {"disaggregation_mode": "decode", "kv_transfer_config": {"kv_role": "kv_producer"}},
            "disagree",
        ),
        ({"disaggregation_mode": "prefill", "kv_transfer_protocol": "udp"}, "tcp or rdma"),
        ({"kv_transfer_timeout_s": 0}, "kv_transfer_timeout_s"),
        (
            {"disaggregation_mode": "decode", "kv_transfer_store": "10.0.0.9:50051"},
            "kv_transfer_store must look like mooncake://HOST:PORT",
        ),
        (
            {
                "kv_transfer_config": '{"kv_connector": "MooncakeStoreConnector", "kv_role": '
                '"kv_consumer"}'
            },
            "master_server_address",
        ),
    ]
    for fields, message in cases:
        with pytest.raises(PyptoError, match=message):
            ServerConfig(**fields).validate()
    vllm = ServerConfig(
        kv_transfer_config='{"kv_connector": "MooncakeConnector", '
        '"kv_role": "kv_consumer", "kv_ip": "10.0.0.2", '
        '"kv_connector_extra_config": {"mooncake_protocol": "rdma"}}'
    )
    assert vllm.transfer() == TransferSpec("decode", "10.0.0.2", "rdma")
    store = ServerConfig(
        kv_transfer_config='{"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_producer", '
        '"kv_connector_extra_config": {"master_server_address": "10.0.0.9:50051"}}'
    )
    assert store.transfer() == TransferSpec("prefill", None, "tcp", "mooncake://10.0.0.9:50051")
    assert ServerConfig(disaggregation_mode="null").transfer() is None
    with pytest.raises(PyptoError, match=r"kv_transfer_store: the Mooncake master .* does not"):
        store_gone = "mooncake://127.0.0.1:9"
        run_server({}, ServerConfig(disaggregation_mode="prefill", kv_transfer_store=store_gone))
    with pytest.raises(PyptoError, match="runs one engine"):  # before anything starts
        run_server({"data_parallel_size": 2}, ServerConfig(disaggregation_mode="prefill"))
    with pytest.raises(PyptoError, match="decode server"):
        RouterConfig([], []).validate()
    with pytest.raises(PyptoError, match="http"):
        RouterConfig([], ["ftp://x"]).validate()
    p, d = ["http://a:1", "http://b:1"], ["http://c:1"]
    with pytest.raises(PyptoError, match="one endpoint per prefill server"):
        RouterConfig(p, d, kv_events=["tcp://a:5557"]).validate()
    with pytest.raises(PyptoError, match="tcp://HOST:PORT"):
        RouterConfig(p, d, kv_events=["tcp://a:5557", "a:5557"]).validate()
    with pytest.raises(PyptoError, match="go together"):
        RouterConfig(p, d, kv_events_key="router.key_secret").validate()
    with pytest.raises(PyptoError, match="CURVE keys"):
        RouterConfig(p, d, kv_events_server_key="/none.key", kv_events_key="/x").validate()
    # the command line says it the same way, without a traceback
    cli = [sys.executable, "-m", "pypto_serving.cli", "router", "--prefill", *p, "--decode", *d]
    done = subprocess.run([*cli, "--kv-events", "tcp://a:1"], capture_output=True, text=True)
    assert done.returncode != 0 and "one endpoint per prefill server" in done.stderr
    assert "Traceback" not in done.stderr


def test_forwarded_prompt_token_ids_are_the_prompt(tiny_model) -> None:
    """vLLM's `kv_transfer_params.prompt_token_ids`: a decode request's prompt, taken as is."""
    with tiny_llm(tiny_model("llama-gqa4-tied")) as llm, serving(llm) as live:
        ids = PROMPTS[1]
        body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        chat = body | {"messages": [{"role": "user", "content": "other words"}]}
        r = httpx.post(
            live.url + "/v1/chat/completions",
            json=chat | {"kv_transfer_params": {"prompt_token_ids": ids}},
        )
        assert r.status_code == 200 and r.json()["prompt_token_ids"] == ids
        plain = httpx.post(live.url + "/v1/completions", json=body | {"prompt": ids}).json()
        assert r.json()["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
        for bad in (["a"], [], "1 2"):
            r = httpx.post(
                live.url + "/v1/chat/completions",
                json=chat | {"kv_transfer_params": {"prompt_token_ids": bad}},
            )
            assert r.status_code == 400 and "prompt_token_ids" in r.text


def test_the_router_sends_a_prompt_to_the_prefill_server_that_cached_its_prefix(tiny_model):
    path = tiny_model("llama-gqa4-tied")
    transfers = [KVTransfer(role, "127.0.0.1") for role in ("prefill", "prefill", "decode")]
    with contextlib.ExitStack() as stack:
        llms = [stack.enter_context(tiny_llm(path)) for _ in range(3)]
        a, b, d = (
            stack.enter_context(serving(llm, transfer=t))
            for llm, t in zip(llms, transfers, strict=True)
        )
        router = stack.enter_context(routing([a.url, b.url], [d.url]))
        stem = PROMPTS[3][:64]
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0}
        for i in range(6):  # the stem, then the stem with a different tail each time
            r = httpx.post(router + "/v1/completions", json=body | {"prompt": stem + [7 + i] * i})
            assert r.status_code == 200, r.text
        hits = [llm.engine.stats().prefix_hits for llm in llms[:2]]
        served = [llm.engine.stats().prefix_queries for llm in llms[:2]]
        assert sorted(hits) == [0, 5 * 64] and min(served) == 0  # one server took all six
        metrics = httpx.get(router + "/metrics").text
        assert "pypto_router_prefix_tokens_total 320.0" in metrics  # 5 x 4 pages of 16
        # a text prompt is tokenized by a prefill server first, and follows its prefix too
        words = "the quick brown fox jumps over the lazy dog " * 8
        for tail in ("", "paris", "hello world"):
            r = httpx.post(router + "/v1/completions", json=body | {"prompt": words + tail})
            assert r.status_code == 200
        queries = [llm.engine.stats().prefix_queries for llm in llms[:2]]
        assert sorted(q - s for q, s in zip(queries, served, strict=True))[0] == 0
    for t in transfers:
        t.close()


def estimated(router: str, server: str) -> float:
    """The router's estimate of the pages `server` caches (its /metrics)."""
    for line in httpx.get(router + "/metrics").text.splitlines():
        if line.startswith(f'pypto_router_prefix_pages{{server="{server}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no estimate for {server}")


def test_the_routers_prefix_estimate_follows_the_servers_kv_events(tiny_model) -> None:
    """With --kv-events the router knows what a prefill server caches from the server itself:
    a prompt another client sent it counts, and pages it evicted stop counting."""
    path = tiny_model("llama-gqa4-tied")
    transfers = [KVTransfer(role, "127.0.0.1") for role in ("prefill", "prefill", "decode")]
    events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    small = {"num_kv_pages": 12, "kv_cpu_bytes": 0}  # 192 tokens, nothing offloaded
    with contextlib.ExitStack() as stack:
        llms = [stack.enter_context(tiny_llm(path, kv_events_endpoint=e, **small)) for e in events]
        llms.append(stack.enter_context(tiny_llm(path)))
        a, b, d = (
            stack.enter_context(serving(llm, transfer=t))
            for llm, t in zip(llms, transfers, strict=True)
        )
        router = stack.enter_context(routing([a.url, b.url], [d.url], kv_events=events))
        body = {"model": "tiny", "max_tokens": 1, "temperature": 0}

        def direct(url: str, prompt: list[int]) -> None:  # not through the router
            r = httpx.post(url + "/v1/completions", json=body | {"prompt": prompt})
            assert r.status_code == 200, r.text

        deadline = time.monotonic() + patience(30)
        for i in itertools.count():  # until the router's subscription is up (ZeroMQ connects
            direct(b.url, [i % 300 + 7] * 20)  # in the background): a fresh page each time
            if estimated(router, b.url) > 0:
                break
            assert time.monotonic() < deadline, "no KV event reached the router"
            time.sleep(0.1)
        stem, before = PROMPTS[3][:64], estimated(router, b.url)
        direct(b.url, stem)  # b caches the stem's 4 pages; the router did not send it there
        deadline = time.monotonic() + patience(30)
        while estimated(router, b.url) < before + 4:
            assert time.monotonic() < deadline, "the stem's pages never reached the estimate"
            time.sleep(0.05)
        r = httpx.post(router + "/v1/completions", json=body | {"prompt": [*stem, 9, 9]})
        assert r.status_code == 200
        metrics = httpx.get(router + "/metrics").text
        assert "pypto_router_prefix_tokens_total 64.0" in metrics  # sent where it was cached
        assert f'role="prefill",server="{a.url}"' not in metrics
        assert llms[1].engine.stats().prefix_hits == 64
        # b evicts the stem for a prompt as long as its whole pool: the router learns it
        direct(b.url, [(31 * j) % 250 + 5 for j in range(180)])  # 12 pages, 11 of them full
        deadline = time.monotonic() + patience(30)
        while estimated(router, b.url) != 11:  # its 11 full pages, everything else evicted
            assert time.monotonic() < deadline, "the evicted pages still count"
            time.sleep(0.05)
        r = httpx.post(router + "/v1/completions", json=body | {"prompt": [*stem, 8, 8]})
        assert r.status_code == 200
        metrics = httpx.get(router + "/metrics").text
        assert "pypto_router_prefix_tokens_total 64.0" in metrics  # nothing counted this time
    for t in transfers:
        t.close()


def test_the_router_fronts_ordinary_servers_by_prefix(tiny_model) -> None:
    """Without prefill servers the router spreads whole requests over ordinary servers
    (prefix-aware DP across machines): prompts sharing a stem go where it is cached."""
    path = tiny_model("llama-gqa4-tied")
    with contextlib.ExitStack() as stack:
        llms = [stack.enter_context(tiny_llm(path)) for _ in range(2)]
        a, b = (stack.enter_context(serving(llm)) for llm in llms)
        router = stack.enter_context(routing([], [a.url, b.url]))
        stem = PROMPTS[3][:64]
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0}
        for i in range(6):
            r = httpx.post(router + "/v1/completions", json=body | {"prompt": stem + [7 + i] * i})
            assert r.status_code == 200, r.text
        hits = sorted(llm.engine.stats().prefix_hits for llm in llms)
        queries = sorted(llm.engine.stats().prefix_queries for llm in llms)
        assert hits == [0, 5 * 64] and queries[0] == 0  # one server took all six
        metrics = httpx.get(router + "/metrics").text
        assert "pypto_router_prefix_tokens_total 320.0" in metrics
        # different prompts still spread over both (the least busy, in turn)
        for i in range(4):
            prompt = [(13 * i + j) % 250 + 5 for j in range(20)]
            r = httpx.post(router + "/v1/completions", json=body | {"prompt": prompt})
            assert r.status_code == 200
        assert min(llm.engine.stats().prefix_queries for llm in llms) > 0


def test_a_handoff_without_room_waits_for_it_and_is_not_lost(tiny_model) -> None:
    """A decode server whose pool is full when a handoff comes reads it into host memory
    (it cannot reserve its pages) and admits it once room frees: the same tokens."""
    path = tiny_model("llama-gqa4-tied")
    sends, gets = KVTransfer("prefill", "127.0.0.1"), KVTransfer("decode", "127.0.0.1")
    with contextlib.ExitStack() as stack:
        stack.callback(sends.close)
        stack.callback(gets.close)
        alone_llm, p_llm = (stack.enter_context(tiny_llm(path)) for _ in range(2))
        d_llm = stack.enter_context(tiny_llm(path, num_kv_pages=8, kv_cpu_bytes=0))
        alone = stack.enter_context(serving(alone_llm))
        p = stack.enter_context(serving(p_llm, transfer=sends))
        d = stack.enter_context(serving(d_llm, transfer=gets))
        router = stack.enter_context(routing([p.url], [d.url]))
        handed = {"model": "tiny", "temperature": 0, "ignore_eos": True, "max_tokens": 6}
        handed["prompt"] = PROMPTS[3][:60]

        def on_engine_thread(fn: Any, *args: Any) -> Any:  # between steps, as the server does
            return d.engine._thread.submit(fn, *args).result()

        assert on_engine_thread(d_llm.engine.reserve, "elsewhere-0", [8])  # the whole pool
        answer: list[httpx.Response] = []
        asking = threading.Thread(
            target=lambda: answer.append(
                httpx.post(router + "/v1/completions", json=handed, timeout=patience(120))
            )
        )
        asking.start()
        deadline = time.monotonic() + patience(60)
        while gets.stats.pulled == 0:  # read, with no room to reserve: it waits for room
            assert time.monotonic() < deadline, "the handoff was never read"
            time.sleep(0.05)
        time.sleep(0.2)
        assert not answer and gets.stats.no_room == 1
        on_engine_thread(d_llm.engine.unreserve, "elsewhere-0")  # room: it is admitted
        asking.join(timeout=patience(60))
        assert answer and answer[0].status_code == 200, answer
        want = httpx.post(alone.url + "/v1/completions", json=handed).json()["choices"][0]["text"]
        assert answer[0].json()["choices"][0]["text"] == want
        assert gets.stats.pulled == 1 and d_llm.engine.stats().prompt_tokens == 0
        assert all(not m.reserved for m in d_llm.engine.executor.kv.managers)
