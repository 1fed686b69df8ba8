"""Beyond one machine, across real network interfaces (issue 28, items 1-3): hosts are Linux
network namespaces joined by veth pairs on a private network that exists only inside the test
(`netns.py`); each runs its own processes.

- Two `pypto serve` processes on two hosts share one Mooncake master on a third: a prompt
  served by A is a remote-tier hit on B, with the tokens A computed; killing the master
  mid-run costs recompute, never a request.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import netns
import pytest
from live_server import FAST_KNOBS
from mooncake_master import master_command, pool_env
from patience import patience

from pypto_serving.distributed import COLLECTIVES_ENV

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

MODEL = "llama-gqa4-tied"
MASTER_PORT = 50051
HTTP_PORT = 8000


def wait_until(check: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + patience(seconds)
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def listening(host: netns.Host, address: str, port: int) -> bool:
    import socket

    def connect() -> bool:
        try:
            socket.create_connection((address, port), timeout=1.0).close()
            return True
        except OSError:
            return False

    return host.call(connect)


@contextmanager
def serve(
    host: netns.Host,
    model: Path,
    *flags: str,
    watch: subprocess.Popen[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen[str]]:
    """`pypto serve` on a host, at http://ADDRESS:8000, until the block ends (failing at once
    if it, or the `watch` process it needs, exits first)."""
    knobs = [f"--{k.replace('_', '-')}={v}" for k, v in FAST_KNOBS.items() if k != "enforce_eager"]
    argv = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(model)]
    argv += ["--host", host.address, "--port", str(HTTP_PORT), "--enforce-eager", *knobs, *flags]
    proc = host.run(argv, stderr=subprocess.PIPE, env=env)
    try:

        def up_or_gone() -> bool:
            gone = proc.poll() is not None or (watch is not None and watch.poll() is not None)
            return gone or listening(host, host.address, HTTP_PORT)

        wait_until(up_or_gone, 120, f"pypto serve on {host.address}")
        assert watch is None or watch.poll() is None, f"exited with {watch.returncode}"
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        yield proc
    finally:
        proc.kill()
        proc.wait()


def complete(client: netns.Host, server: netns.Host, prompt: list[int]) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}

    def post() -> dict[str, Any]:
        url = f"http://{server.address}:{HTTP_PORT}/v1/completions"
        r = httpx.post(url, json=body, timeout=patience(60))
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    return client.call(post)


def pages_written(client: netns.Host, server: netns.Host) -> float:
    """The pages a server has written to the shared pool, from its /metrics."""

    def scrape() -> float:
        text = httpx.get(f"http://{server.address}:{HTTP_PORT}/metrics", timeout=10).text
        found = re.search(
            r'pypto_kv_tier_stored_pages_total\{[^}]*tier="remote"[^}]*\} (\S+)', text
        )
        return float(found.group(1)) if found else 0.0

    return client.call(scrape)


def prompt(i: int, n: int = 100) -> list[int]:
    return [(13 * i + 7 * j) % 290 + 7 for j in range(n)]


def tiers(answer: dict[str, Any]) -> dict[str, int]:
    """The tiers the prompt's cached tokens came from (those that gave some)."""
    per_tier = answer["usage"]["prompt_tokens_details"]["cached_tokens_per_tier"]
    return {tier: n for tier, n in per_tier.items() if n}


@pytest.mark.slow
def test_two_servers_on_two_hosts_share_one_mooncake_master_on_a_third(tiny_model):
    model = tiny_model(MODEL)
    with netns.hosts(3) as (a, b, m):
        master = m.run(
            master_command(MASTER_PORT, 9003), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            wait_until(lambda: listening(m, m.address, MASTER_PORT), 30, "the master")
            remote = [
                "--kv-remote",
                f"mooncake://{m.address}:{MASTER_PORT}",
                "--kv-remote-bytes",
                "64MiB",
                "--kv-cpu-bytes",
                "0",
            ]
            env = pool_env()  # every member knows the pool's secret
            with serve(a, model, *remote, env=env), serve(b, model, *remote, env=env):
                long = prompt(0)
                first = complete(m, a, long)
                assert tiers(first) == {}
                wait_until(  # A writes its pages to the pool from a background thread
                    lambda: pages_written(m, a) >= 6, 30, "A's pages in the pool"
                )
                second = complete(m, b, long)
                assert tiers(second) == {"remote": 96}  # 6 full pages before the last token
                assert second["choices"][0]["text"] == first["choices"][0]["text"]

                master.kill()  # mid-run: B and A go on, recomputing
                master.wait()
                for i in (1, 2):
                    on_a, on_b = complete(m, a, prompt(i)), complete(m, b, prompt(i))
                    assert on_b["choices"][0]["text"] == on_a["choices"][0]["text"]
                    assert tiers(on_b) == {}
                again = complete(m, b, long)  # still on B's device
                assert again["choices"][0]["text"] == first["choices"][0]["text"]
        finally:
            master.kill()
            master.wait()


@pytest.mark.slow
@pytest.mark.parametrize("dimension", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_one_rank_on_each_of_two_hosts_gives_the_tokens_of_one(tiny_model, dimension):
    """TP=2 (or PP=2) with rank 0 on host A (it serves) and rank 1 on host B (headless):
    greedy tokens identical to one rank's. The hosts share this machine's /dev/shm, where the
    ranks would meet in shared memory: gloo is asked for, so every collective crosses the
    network as between two machines."""
    from live_server import tiny_llm

    from pypto_serving.sampling import SamplingParams

    model = tiny_model("qwen2-gqa2")
    prompts = [prompt(i, 40) for i in range(3)]
    with tiny_llm(model) as one:
        params = SamplingParams(max_tokens=8, temperature=0)
        expected = [o.outputs[0].text for o in one.generate(prompts, params, use_tqdm=False)]
    with netns.hosts(2) as (a, b):
        group = [dimension, "2", "--nnodes", "2", "--master-addr", a.address]
        group += ["--master-port", "29500", "--startup-timeout-s", "120"]
        knobs = [f"--{k.replace('_', '-')}={v}" for k, v in FAST_KNOBS.items() if v is not True]
        argv = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(model)]
        argv += ["--enforce-eager", *knobs, *group, "--node-rank", "1", "--headless"]
        env = os.environ | {COLLECTIVES_ENV: "gloo"}
        node1 = b.run(argv, env=env)
        try:
            with serve(a, model, *group, "--node-rank", "0", watch=node1, env=env):
                got = [complete(b, a, p)["choices"][0]["text"] for p in prompts]
                assert got == expected
        finally:
            node1.kill()
            node1.wait()


@pytest.mark.slow
def test_data_parallel_replicas_on_two_hosts_behind_one_router(tiny_model):
    """`--data-parallel-size 2 --nnodes 2`: host A serves HTTP and one replica, host B
    (headless) the other, its channel to A's router crossing the network. Round robin sends
    half the requests to B: the tokens of one engine. When B goes away A's /health says
    which replica it lost, and A serves on alone."""
    from live_server import tiny_llm

    from pypto_serving.engine.nodes import SECRET_ENV
    from pypto_serving.sampling import SamplingParams

    model = tiny_model(MODEL)
    prompts = [prompt(i, 40) for i in range(5)]
    with tiny_llm(model) as one:
        params = SamplingParams(max_tokens=8, temperature=0)
        expected = [o.outputs[0].text for o in one.generate(prompts, params, use_tqdm=False)]
    with netns.hosts(2) as (a, b):
        group = ["--data-parallel-size", "2", "--nnodes", "2", "--master-addr", a.address]
        group += ["--master-port", "29500", "--startup-timeout-s", str(patience(120))]
        knobs = [f"--{k.replace('_', '-')}={v}" for k, v in FAST_KNOBS.items() if v is not True]
        argv = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(model)]
        argv += ["--enforce-eager", *knobs, *group, "--node-rank", "1", "--headless"]
        env = os.environ | {SECRET_ENV: "multi-host-test-secret-0123"}
        node1 = b.run(argv, env=env, stderr=subprocess.PIPE)
        try:
            balance = ["--data-parallel-load-balance", "round_robin"]
            with serve(a, model, *group, *balance, "--node-rank", "0", watch=node1, env=env):
                got = [complete(b, a, p)["choices"][0]["text"] for p in prompts[:4]]
                assert got == expected[:4]

                def health() -> httpx.Response:
                    return httpx.get(f"http://{a.address}:{HTTP_PORT}/health", timeout=10)

                assert b.call(health).status_code == 200
                node1.kill()
                wait_until(lambda: b.call(health).status_code == 503, 30, "B's loss noticed")
                error = b.call(health).json()["error"]
                assert error["code"] == "degraded"
                assert "replica 1 stopped: its channel to node 1 closed" in error["message"]
                assert complete(b, a, prompts[4])["choices"][0]["text"] == expected[4]
        finally:
            node1.kill()
            node1.wait()


def test_a_node_that_never_arrives_is_named_within_the_start_up_limit(tiny_model):
    model = tiny_model("qwen2-gqa2")
    with netns.hosts(2) as (a, _b):
        knobs = [f"--{k.replace('_', '-')}={v}" for k, v in FAST_KNOBS.items() if v is not True]
        argv = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(model)]
        argv += ["--enforce-eager", *knobs, "--tensor-parallel-size", "2", "--nnodes", "2"]
        argv += ["--master-addr", a.address, "--master-port", "29500", "--host", a.address]
        node0 = a.run([*argv, "--startup-timeout-s", "5"], stderr=subprocess.PIPE)
        try:
            _, err = node0.communicate(timeout=patience(120))
        finally:
            node0.kill()
        assert node0.returncode == 1
        assert (
            f"node(s) 1 never arrived: rank(s) 1 did not join the rendezvous at {a.address}" in err
        )
        assert "Traceback" not in err
