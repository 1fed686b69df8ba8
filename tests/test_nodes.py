"""Data-parallel replicas on several nodes (engine/nodes.py; issue 28 item 2), with both
nodes on this machine: node 0 is an `LLM` in this process, node 1 a `pypto serve
--node-rank 1 --headless` process whose replicas reach node 0 over TCP on the loopback
device. (tests/test_multi_host.py runs the nodes on two hosts joined by a real network.)

Ground truth: one engine's greedy tokens. A remote replica is a replica: requests routed to
it give the same tokens, its step results reach node 0's router, and losing it (its node
stops) leaves node 0 serving with the replicas it has left. The channel admits only a peer
that knows the nodes' secret; a node that never arrives is named within the start-up limit.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from multiprocessing import Pipe
from pathlib import Path
from typing import Any

import pytest
from live_server import FAST_KNOBS, free_port, tiny_llm
from patience import patience, wait_for

from pypto_serving.config import engine_config
from pypto_serving.engine.nodes import (
    SECRET_ENV,
    NodeListener,
    RemoteReplica,
    connect_to_front,
    model_fingerprint,
    node_secret,
    relay,
)
from pypto_serving.engine.process import StartupDeadline
from pypto_serving.engine.replica import NewRequest, StepResult, TokenDelta
from pypto_serving.errors import PyptoError
from pypto_serving.ops.sampler import Sampled
from pypto_serving.sampling import SamplingParams

SECRET = "test-secret-0123456789abcdef"
PROMPTS = [[(13 * i + 7 * j) % 290 + 7 for j in range(20 + 9 * i)] for i in range(4)]


@pytest.fixture(autouse=True)
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def node_config(port: int, node_rank: int, timeout_s: float = 30.0, **parallel: Any):
    return engine_config(
        model="unused",
        data_parallel_size=2,
        nnodes=2,
        node_rank=node_rank,
        master_addr="127.0.0.1",
        master_port=port,
        startup_timeout_s=timeout_s,
        **parallel,
    )


@contextmanager
def node_one(model: Path, port: int, *flags: str) -> Iterator[subprocess.Popen[str]]:
    """`pypto serve --node-rank 1 --headless` of a two-node, two-replica engine."""
    knobs = [f"--{k.replace('_', '-')}={v}" for k, v in FAST_KNOBS.items() if v is not True]
    argv = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(model)]
    argv += ["--enforce-eager", *knobs, "--data-parallel-size", "2", "--nnodes", "2"]
    argv += ["--node-rank", "1", "--headless", "--master-addr", "127.0.0.1"]
    argv += ["--master-port", str(port), "--startup-timeout-s", str(patience(120)), *flags]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def node_zero(model: Path, port: int, **knobs: Any):
    return tiny_llm(
        model,
        data_parallel_size=2,
        nnodes=2,
        master_addr="127.0.0.1",
        master_port=port,
        data_parallel_load_balance="round_robin",
        startup_timeout_s=patience(120),
        **knobs,
    )


def tokens(llm: Any, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]


@pytest.mark.slow
def test_a_replica_on_another_node_serves_like_a_local_one_and_its_loss_is_survived(
    tiny_model,
):
    model = tiny_model("llama-gqa4-tied")
    with tiny_llm(model) as one:
        expected = tokens(one)
    port = free_port()
    with node_one(model, port) as node1, node_zero(model, port) as llm:
        engine = llm.engine
        assert engine.replicas[0].where.startswith("pid ")
        assert engine.replicas[1].where == f"node 1 pid {engine.replicas[1].info.pid}"
        assert tokens(llm) == expected  # round robin: half of them on node 1
        remote = engine._stats[1]
        assert remote.generation_tokens == 2 * 8 and remote.prompt_tokens > 0
        assert engine.router._held[1]  # node 1's KV events reached node 0's router

        node1.kill()  # the whole node goes away
        wait_for(lambda: engine.degraded is not None, patience(30), "node 1's loss")
        assert engine.degraded == ("data-parallel replica 1 stopped: its channel to node 1 closed")
        assert tokens(llm) == expected  # all on replica 0 now
    assert node1.returncode is not None


@pytest.mark.slow
def test_dp_attention_and_ep_span_two_nodes_and_node_zero_stops_both(tiny_model, monkeypatch):
    """DeepSeek-V4's MoE layers with their experts split between a replica on each node
    (the replicas' group meets at master_port + 1): the tokens of one engine. Node 0
    closing stops node 1's replica, and node 1 exits 0."""
    monkeypatch.setenv("PYPTO_TP_COLLECTIVES", "gloo")  # as between two machines
    model = tiny_model("deepseekv4-swa-csa-hca-hash")
    with tiny_llm(model) as one:
        expected = tokens(one)
    port = free_port()
    with node_one(model, port, "--enable-expert-parallel") as node1:
        with node_zero(model, port, enable_expert_parallel=True) as llm:
            infos = [r.info for r in llm.engine.replicas]
            assert [i.experts for i in infos if i] == [[[0, 1]], [[2, 3]]]  # one rank each
            assert tokens(llm) == expected
            held = llm.engine.router._held  # V4's whole pages, told by each node's replica
            assert held[0] and held[1]
        _, err = node1.communicate(timeout=patience(60))
    assert node1.returncode == 0, err[-2000:]
    assert "node 0 stopped its replicas" in err


def test_a_node_that_never_arrives_is_named_within_the_start_up_limit(tiny_model):
    model = tiny_model("llama-gqa4-tied")
    port = free_port()
    started = time.monotonic()
    with pytest.raises(PyptoError) as e:
        tiny_llm(model, data_parallel_size=2, nnodes=2, master_port=port, startup_timeout_s=3)
    assert str(e.value).startswith(
        "node(s) 1 never arrived: data-parallel replica(s) 1 did not connect to "
        f"127.0.0.1:{port} within 3 s"
    )
    assert time.monotonic() - started < patience(60)


def test_the_other_node_alone_says_where_node_zero_should_be(tiny_model, capsys):
    from pypto_serving.cli import main

    model = tiny_model("llama-gqa4-tied")
    port = free_port()
    argv = ["serve", "--model", str(model), "--dtype", "float32", "--enforce-eager"]
    argv += ["--data-parallel-size", "2", "--nnodes", "2", "--node-rank", "1"]
    argv += ["--master-port", str(port), "--startup-timeout-s", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"node 1 cannot reach node 0 at 127.0.0.1:{port} within 2 s" in err
    assert "is `pypto serve --node-rank 0` running there" in err
    assert "Traceback" not in err


def test_every_node_needs_the_shared_secret(monkeypatch, tiny_model):
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(PyptoError, match=f"set {SECRET_ENV} to the same secret"):
        node_secret()
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(PyptoError, match="at least 16 characters"):
        node_secret()
    model = tiny_model("llama-gqa4-tied")
    with pytest.raises(PyptoError, match=SECRET_ENV):  # before any replica starts
        tiny_llm(model, data_parallel_size=2, nnodes=2, master_port=free_port())


def test_a_peer_without_the_secret_is_refused_and_the_node_with_it_admitted(
    monkeypatch, caplog, tmp_path
):
    port = free_port()
    config = node_config(port, 0)
    listener = NodeListener(config, tmp_path)
    serves = model_fingerprint(node_config(port, 1), tmp_path)
    found: list[RemoteReplica] = []
    accept = threading.Thread(
        target=lambda: found.extend(listener.accept([1], StartupDeadline.after(patience(30))))
    )
    accept.start()
    try:
        with caplog.at_level(logging.WARNING):
            monkeypatch.setenv(SECRET_ENV, "another-secret-0123456789")
            intruder = replace(node_config(port, 1), device="cpu")
            with pytest.raises(PyptoError, match="refused node 1: PYPTO_NODE_SECRET differs"):
                connect_to_front(intruder, serves, 1, 4242, StartupDeadline.after(patience(30)))
            raw = socket.create_connection(("127.0.0.1", port))  # says nothing at all
            monkeypatch.setenv(SECRET_ENV, SECRET)
            conn, offset = connect_to_front(
                node_config(port, 1), serves, 1, 4243, StartupDeadline.after(patience(30))
            )
            accept.join(patience(30))
    finally:
        listener.close()
    assert [(r.index, r.node_rank, r.pid) for r in found] == [(1, 1, 4243)]
    assert "does not know PYPTO_NODE_SECRET" in caplog.text
    assert abs(offset) < 0.5  # one machine: one monotonic clock, up to a round trip
    # the channel carries messages both ways and its end is seen without reading
    found[0].send(None)
    assert conn.recv() is None
    assert found[0].poll() is None
    conn.send("never read")  # the end must show behind a message nobody read
    assert found[0].poll() is None
    conn.close()
    wait_for(lambda: found[0].poll() is not None, patience(10), "the channel's end")
    found[0].kill()
    raw.close()


def test_a_node_serving_another_model_stops_start_up_on_both_nodes(tmp_path):
    """Replicas of one engine must give the same tokens: a node whose model files or
    token-changing options differ is refused, node 0 stops at once, and both say why."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    port = free_port()
    listener = NodeListener(node_config(port, 0), model)
    failed: list[BaseException] = []

    def accept() -> None:
        try:
            listener.accept([1], StartupDeadline.after(patience(30)))
        except PyptoError as e:
            failed.append(e)

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        other = node_config(port, 1, dtype="bfloat16")
        serves = model_fingerprint(other, model)
        with pytest.raises(PyptoError) as refused:
            connect_to_front(other, serves, 1, 4242, StartupDeadline.after(patience(30)))
        thread.join(patience(10))
    finally:
        listener.close()
    why = "node 1 serves m (dtype bfloat16"
    assert f"node 0 at 127.0.0.1:{port} refused data-parallel replica 1: {why}" in str(
        refused.value
    )
    assert len(failed) == 1 and str(failed[0]).startswith(why)
    assert "node 0 serves m (dtype auto" in str(failed[0])
    assert "start every node with the same model and options" in str(failed[0])


def test_the_model_fingerprint_follows_files_and_options(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"x" * 100)
    base = model_fingerprint(node_config(1, 0), model)
    assert model_fingerprint(node_config(1, 1), model) == base  # the node's rank is not it
    assert model_fingerprint(node_config(1, 0, quantization="int8"), model) != base
    (model / "model.safetensors").write_bytes(b"x" * 101)
    assert model_fingerprint(node_config(1, 0), model) != base
    (model / "model.safetensors").write_bytes(b"x" * 100)
    (model / "config.json").write_text('{"hidden_size": 65}')
    assert model_fingerprint(node_config(1, 0), model) != base


class FakeReplica:
    """A replica's parent-side end of a pipe, for the relay."""

    def __init__(self) -> None:
        self.conn, self.child = Pipe()
        self.ended = ""

    def stop(self) -> None:
        self.ended = "stopped"

    def kill(self) -> None:
        self.ended = "killed"


def test_the_relay_moves_times_between_the_clocks_of_the_two_nodes():
    """Node r's monotonic clock is `offset` ahead of node 0's: a request's arrival moves
    forward on the way in, a step's scheduled time back on the way out."""
    replica = FakeReplica()
    front, node0 = Pipe()
    offset = 1000.0
    ended: list[bool] = []
    thread = threading.Thread(target=lambda: ended.append(relay(replica, front, offset)))  # type: ignore[arg-type]
    thread.start()
    node0.send(NewRequest("r", [1, 2], greedy(), (), 0, 0, 5.0, None))
    got = replica.child.recv()
    assert isinstance(got, NewRequest) and got.arrival_time == 1005.0
    delta = TokenDelta("r", [Sampled(7, 0.0, None)], None, 0, 1010.0)
    replica.child.send(StepResult([delta], None))  # type: ignore[arg-type]
    back = node0.recv()
    assert isinstance(back, StepResult) and back.deltas[0].scheduled_time == 10.0
    node0.send(None)  # node 0 stops the replica: passed on, and the end is clean
    assert replica.child.recv() is None
    replica.child.close()  # the replica exits
    thread.join(patience(10))
    assert ended == [True] and replica.ended == "stopped"
    assert node0.poll(patience(5)) and _eof(node0)


def test_the_relay_kills_the_replica_when_node_zero_goes_away():
    replica = FakeReplica()
    front, node0 = Pipe()
    ended: list[bool] = []
    thread = threading.Thread(target=lambda: ended.append(relay(replica, front, 0.0)))  # type: ignore[arg-type]
    thread.start()
    node0.close()
    thread.join(patience(10))
    assert ended == [False] and replica.ended == "killed"


def _eof(conn: Any) -> bool:
    try:
        conn.recv()
    except EOFError:
        return True
    return False


def test_tp_within_each_replica_with_the_replicas_spread_over_the_nodes_is_valid():
    """(The errors of multi-node options: tests/test_tensor_parallel.py.)"""
    engine_config(
        model="unused", nnodes=2, master_port=29500, data_parallel_size=2, tensor_parallel_size=2
    )
