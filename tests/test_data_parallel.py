"""Data parallelism: replica processes behind one engine, for `LLM` and the server.

Ground truth is the single-process engine: every request's tokens (greedy, and seeded
sampling with logprobs) must be the same whichever replica computed them.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from fault_injection import FAIL_REPLICA_START, HANG_REPLICA_START, inject
from live_server import FAST_KNOBS, serving, tiny_llm
from parallel_checks import children_of, config_error, gone
from patience import patience, wait_for

from pypto_serving.distributed import Group
from pypto_serving.engine.dp import DPEngine, ReplicaDiedError
from pypto_serving.errors import PyptoError, RequestFailedError
from pypto_serving.sampling import SamplingParams

MODEL = "qwen3-hd32-gqa4"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_k=20, max_tokens=8, seed=7, n=2, logprobs=2)
SCORED = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)


def scores(llm) -> list[list[tuple[int, float, int | None]]]:
    """Each prompt's prompt logprobs (token, logprob, rank) after the first token."""
    result = llm.generate(prompts(), SCORED, use_tqdm=False)
    return [[(s.token_id, s.logprob, s.rank) for s in r.prompt_logprobs[1:]] for r in result]


def prompts() -> list[list[int]]:
    system = [(5 * j) % 250 + 3 for j in range(40)]  # shared by every other prompt
    return [
        (
            [*system, *range(3, 3 + i)]
            if i % 2
            else [(7 * i + j) % 300 + 3 for j in range(5 + 9 * i)]
        )
        for i in range(10)
    ]


def outputs(llm, params: SamplingParams) -> list[list[tuple[list[int], str]]]:
    result = llm.generate(prompts(), params, use_tqdm=False)
    return [[(o.token_ids, o.text) for o in r.outputs] for r in result]


@pytest.fixture(scope="module")
def single(tiny_model):
    with tiny_llm(tiny_model(MODEL)) as llm:
        yield {
            "greedy": outputs(llm, GREEDY),
            "sampled": outputs(llm, SAMPLED),
            "scored": scores(llm),
        }


def test_dp2_gives_each_request_the_single_engine_tokens(tiny_model, single):
    with tiny_llm(tiny_model(MODEL), data_parallel_size=2) as llm:
        engine = llm.engine
        assert isinstance(engine, DPEngine)
        pids = [r.pid for r in engine.replicas]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        groups = [r.info.groups for r in engine.replicas if r.info is not None]
        assert [g.dp for g in groups] == [Group(0, 2), Group(1, 2)]  # each knows its place
        assert all(g.ep == Group() and g.expert_exchange == "none" for g in groups)
        assert outputs(llm, GREEDY) == single["greedy"]
        assert outputs(llm, SAMPLED) == single["sampled"]
        assert scores(llm) == single["scored"]  # prompt logprobs come back from the replicas
        assert engine.router.pending == [0, 0]  # accounting back to zero
        per_replica = [s.generation_tokens for s in engine._stats]
        assert all(n > 0 for n in per_replica), per_replica  # both replicas did work
        assert engine.stats().generation_tokens == sum(per_replica)
        # one at a time (equal loads), a prompt goes where its system prompt is cached
        shared = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts()[1::2]]
        assert all(r.num_cached_tokens >= 32 for r in shared)
    assert all(gone(pid) for pid in pids)


def test_dp2_server_streams_the_single_engine_tokens(tiny_model, single):
    llm = tiny_llm(tiny_model(MODEL), data_parallel_size=2)
    pids = [r.pid for r in llm.engine.replicas]
    with serving(llm) as live:

        def complete(prompt: list[int]) -> str:
            body = {"model": live.model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
            r = httpx.post(
                f"{live.url}/v1/completions",
                json=body | {"ignore_eos": True},
                timeout=patience(60),
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(complete, prompts()))
        assert got == [r[0][1] for r in single["greedy"]]
        assert httpx.get(f"{live.url}/health").status_code == 200
        metrics = httpx.get(f"{live.url}/metrics").text
        assert re.search(r'pypto_generation_tokens_total\{model_name="tiny"\} 120\.0', metrics)
    assert all(gone(pid) for pid in pids)  # the server's shutdown stopped the replicas


def test_a_replica_that_fails_to_start_stops_them_all(tiny_model, monkeypatch):
    inject(monkeypatch, FAIL_REPLICA_START, "1")
    with pytest.raises(PyptoError) as e:
        tiny_llm(tiny_model(MODEL), data_parallel_size=3)
    message = str(e.value)
    assert "replica 1" in message and "injected start-up failure" in message
    pids = [int(p) for p in re.findall(r"pid (\d+)", message)]
    assert len(pids) == 3 and all(gone(pid) for pid in pids)
    assert children_of(os.getpid()) == []


def test_a_replica_that_hangs_while_starting_fails_start_up_naming_it(tiny_model, monkeypatch):
    inject(monkeypatch, HANG_REPLICA_START, "1")
    with pytest.raises(PyptoError) as e:
        tiny_llm(tiny_model(MODEL), data_parallel_size=2, startup_timeout_s=10)
    message = str(e.value)  # replica 0 may be late too on a loaded machine: then both named
    assert re.search(
        r"replica 1 \(pid \d+\).* did not start within startup_timeout_s \(10 s\)", message
    )
    pids = [int(p) for p in re.findall(r"pid (\d+)", message)]
    assert len(pids) == 2 and all(gone(pid) for pid in pids)
    assert children_of(os.getpid()) == []


def test_an_idle_engine_notices_a_killed_replica_by_itself(tiny_model, single):
    """No request in flight, so no step reads the dead replica's pipe: /health must still
    turn 503 `degraded` within seconds, and requests go to the replica left."""
    llm = tiny_llm(tiny_model(MODEL), data_parallel_size=2)
    with serving(llm) as live:
        assert httpx.get(f"{live.url}/health").status_code == 200
        os.kill(llm.engine.replicas[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + patience(60)
        while (health := httpx.get(f"{live.url}/health")).status_code == 200:
            assert time.monotonic() < deadline, "the killed replica was not noticed"
            time.sleep(0.1)
        error = health.json()["error"]
        assert error["code"] == "degraded"
        assert "replica 1 stopped: it exited (code -9)" in error["message"]
        body = {"model": live.model, "prompt": prompts()[2], "max_tokens": 12, "temperature": 0}
        r = httpx.post(
            f"{live.url}/v1/completions", json=body | {"ignore_eos": True}, timeout=patience(60)
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == single["greedy"][2][0][1]
        assert llm.engine.router.live == {0}
        assert httpx.get(f"{live.url}/health").status_code == 503
    llm.close()
    assert children_of(os.getpid()) == []


def test_a_killed_replica_fails_its_requests_and_the_others_keep_serving(tiny_model):
    llm = tiny_llm(tiny_model(MODEL), data_parallel_size=2)
    try:
        victim = llm.engine.replicas[1]
        mine = llm.add(prompts()[0], GREEDY)
        theirs = llm.add(prompts()[2], GREEDY)  # one request on each replica
        assert llm.engine.router.replica_of(theirs.children[0].request_id) == 1
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + patience(30)
        while llm.engine.has_unfinished() and time.monotonic() < deadline:
            llm.step()
        assert theirs.error is not None and "replica 1 stopped: it exited (code -9)" in theirs.error
        assert mine.error is None and len(mine.children[0].output_token_ids) == 12
        assert "data-parallel replica 1 stopped" in llm.engine.degraded
        assert gone(victim.pid)
        # new requests go to the replica left, with the same tokens as before
        again = llm.generate(prompts()[:3], GREEDY, use_tqdm=False)
        assert again[0].outputs[0].token_ids == mine.children[0].output_token_ids
        assert llm.engine.router.live == {0}
        assert llm.engine.stats().num_running == 0
    finally:
        llm.close()
    assert all(gone(r.pid) for r in llm.engine.replicas)


def test_generate_raises_when_a_replica_dies_and_step_when_all_have(tiny_model):
    llm = tiny_llm(tiny_model(MODEL), data_parallel_size=2)
    replicas, real_step = llm.engine.replicas, llm.engine.step

    def step():  # the first step finds replica 1 dead, with its requests in flight
        if not gone(replicas[1].pid):
            os.kill(replicas[1].pid, signal.SIGKILL)
            replicas[1].process.wait()
        return real_step()

    llm.engine.step = step
    try:
        with pytest.raises(RequestFailedError, match="replica 1 stopped: it exited"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert not llm.engine.has_unfinished()  # the other replica's requests were aborted
        os.kill(replicas[0].pid, signal.SIGKILL)
        with pytest.raises(ReplicaDiedError, match="every data-parallel replica has stopped"):
            deadline = time.monotonic() + patience(10)
            while time.monotonic() < deadline:
                llm.step()
        with pytest.raises(ReplicaDiedError, match="every data-parallel replica has stopped"):
            llm.generate(prompts()[:1], GREEDY, use_tqdm=False)
    finally:
        llm.close()


def test_replicas_exit_when_their_parent_is_killed(tiny_model):
    script = textwrap.dedent(
        f"""
        import sys, time
        from pypto_serving import LLM
        llm = LLM({str(tiny_model(MODEL))!r}, data_parallel_size=2, **{FAST_KNOBS!r})
        print(*[r.pid for r in llm.engine.replicas], flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.kill()
        parent.wait()
        wait_for(lambda: all(gone(p) for p in pids), 20, "every replica exited")
    finally:
        parent.kill()


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"data_parallel_size": 0}, "data_parallel_size must be an integer >= 1"),
        ({"data_parallel_size": "2"}, "data_parallel_size must be an integer >= 1"),
        ({"data_parallel_load_balance": "random"}, "data_parallel_load_balance must be one of"),
        (
            {"data_parallel_size": 2, "devices": "cpu"},
            "names 1 device(s) for 2 process(es) on this machine",
        ),
        ({"data_parallel_size": 2, "devices": "cpu,"}, "one device per replica"),
        ({"data_parallel_size": 2, "executor": "reference"}, "need the paged executor"),
        ({"startup_timeout_s": 0}, "startup_timeout_s must be a number > 0"),
        ({"startup_timeout_s": float("nan")}, "startup_timeout_s must be a number > 0"),
    ],
)
def test_parallel_config_errors(knobs, message):
    assert message in config_error(knobs)


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the message of a machine with no GPU"
)
def test_a_device_that_is_not_there_is_refused_before_any_replica_starts(tiny_model):
    with pytest.raises(PyptoError, match="no CUDA GPU is available"):
        tiny_llm(tiny_model(MODEL), data_parallel_size=2, devices="cpu,cuda:1")
    assert children_of(os.getpid()) == []


def test_parallel_section_and_dp_flag(tmp_path, monkeypatch):
    import json

    from pypto_serving.cli import build_parser, main
    from pypto_serving.flags import engine_knobs
    from pypto_serving.server import launch

    argv = ["generate", "--prompt", "x", "--dp", "2", "--tp", "2", "--pp", "3"]
    assert engine_knobs(build_parser().parse_args(argv)) == {
        "data_parallel_size": 2,
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 3,
    }
    seen = {}
    monkeypatch.setattr(launch, "run_server", lambda knobs, server: seen.update(knobs))
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"parallel": {"data_parallel_size": 2, "devices": "cpu,cpu"}}))
    main(["serve", "--config", str(config), "--data-parallel-load-balance", "round_robin"])
    assert seen["data_parallel_size"] == 2 and seen["devices"] == "cpu,cpu"
    assert seen["data_parallel_load_balance"] == "round_robin"
