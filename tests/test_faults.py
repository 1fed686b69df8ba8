"""Faults: a worker killed or hung while serving, SIGTERM draining, a start-up failure, a
parent killed under its workers.

A request lost to a fault ends with a JSON 503 (or an SSE error event, then [DONE]) within
5 s, /health turns 503 within 5 s, and with data parallelism the replicas left keep serving.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fault_injection import FAIL_RANK_START, FAIL_REPLICA_START, fault_env
from live_server import FAST_KNOBS, free_port, serving, tiny_llm
from parallel_checks import gone
from patience import patience, wait_for

MODEL = "llama-gqa4-tied"
PROMPT = [(7 * j) % 300 + 3 for j in range(20)]
LONG = 480  # output tokens: the tiny model's context is 512


@dataclass
class Stream:
    """One streaming completion, read on its own thread."""

    events: list[str] = field(default_factory=list)
    status: int | None = None
    ended: float | None = None


def start_stream(url: str, model: str | None, max_tokens: int = LONG) -> Stream:
    out = Stream()
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }

    def read() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=patience(60)) as r:
            out.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.events.append(line.removeprefix("data: "))
        out.ended = time.monotonic()

    threading.Thread(target=read, daemon=True).start()
    return out


def started_streams(url: str, model: str | None, n: int) -> list[Stream]:
    """`n` long streams, once each has received its first tokens."""
    streams = [start_stream(url, model) for _ in range(n)]
    wait_for(lambda: all(tokens_of(s) >= 2 for s in streams), 30, f"{n} streams started")
    return streams


def tokens_of(stream: Stream) -> int:
    return sum(1 for e in stream.events if e != "[DONE]" and json.loads(e).get("choices"))


def error_of(stream: Stream) -> dict | None:
    """The stream's error event, which must be followed by [DONE] and nothing else."""
    errors = [i for i, e in enumerate(stream.events) if e != "[DONE]" and "error" in json.loads(e)]
    if not errors:
        return None
    assert stream.events[errors[0] + 1 :] == ["[DONE]"], stream.events[-3:]
    return json.loads(stream.events[errors[0]])["error"]


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=patience(5))


def completion(url: str, model: str | None) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=patience(60))


def test_a_killed_replica_fails_its_requests_and_the_others_keep_serving(tiny_model):
    llm = tiny_llm(tiny_model(MODEL), data_parallel_size=2)
    with serving(llm) as live:
        streams = started_streams(live.url, live.model, 4)
        assert llm.engine.router.num_routed == [2, 2]
        os.kill(llm.engine.replicas[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        failed_by = wait_for(lambda: health(live.url).status_code == 503, 5, "/health 503")
        assert failed_by - killed < patience(5)
        problem = health(live.url).json()["error"]
        assert problem["code"] == "degraded" and "replica 1 stopped" in problem["message"]
        wait_for(lambda: all(s.ended for s in streams), 30, "every stream ended")
        lost = [s for s in streams if error_of(s) is not None]
        served = [s for s in streams if s not in lost]
        assert len(lost) == 2 and len(served) == 2
        for s in lost:
            error = error_of(s)
            assert error["code"] == "worker_failed" and "replica 1 stopped" in error["message"]
            assert s.ended - killed < patience(5)
        for s in served:  # the other replica's requests get every token
            assert tokens_of(s) == LONG and s.events[-1] == "[DONE]"
        for _ in range(3):  # and new requests are served by the replica left
            r = completion(live.url, live.model)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert llm.engine.router.live == {0}
    llm.close()


def test_a_hung_replica_is_caught_by_the_watchdog(tiny_model):
    llm = tiny_llm(tiny_model(MODEL), data_parallel_size=2, step_timeout_s=patience(1.5))
    victim = llm.engine.replicas[1].pid
    with serving(llm) as live:
        streams = started_streams(live.url, live.model, 2)
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: all(s.ended for s in streams), 30, "both streams ended")
        (lost,) = [s for s in streams if error_of(s) is not None]
        message = error_of(lost)["message"]
        assert re.search(
            r"replica 1 stopped: no step result or progress for \d+ s \(hung\)", message
        )
        assert lost.ended - stopped < patience(5)
        assert health(live.url).json()["error"]["code"] == "degraded"
        assert completion(live.url, live.model).status_code == 200
    assert gone(victim)
    llm.close()


def test_a_hung_step_is_caught_by_the_watchdog(tiny_model):
    limit = patience(1.0)
    llm = tiny_llm(tiny_model(MODEL), step_timeout_s=limit)
    hang, release = threading.Event(), threading.Event()
    real_step = llm.engine.step

    def step():
        if hang.is_set():
            release.wait(patience(30))
        return real_step()

    llm.engine.step = step
    try:
        with serving(llm) as live:
            stream = start_stream(live.url, live.model)
            wait_for(lambda: tokens_of(stream) >= 2, 30, "the stream started")
            hang.set()
            hung = time.monotonic()
            wait_for(lambda: stream.ended, 5, "the stream ended")
            assert stream.ended - hung < patience(5)
            error = error_of(stream)
            assert error["code"] == "engine_dead"
            assert f"a step made no progress for step_timeout_s ({limit:g} s)" in error["message"]
            r = health(live.url)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            r = completion(live.url, live.model)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        release.set()
    llm.close()


def test_a_killed_tensor_parallel_rank_stops_the_engine_with_errors(tiny_model):
    llm = tiny_llm(tiny_model(MODEL), tensor_parallel_size=2)
    rank1 = llm.engine.workers[0].pid
    with serving(llm) as live:
        streams = started_streams(live.url, live.model, 2)
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: all(s.ended for s in streams), 5, "both streams ended")
        for s in streams:
            error = error_of(s)
            assert error["code"] == "engine_dead"
            assert f"rank 1 (pid {rank1}, exit code -9) stopped" in error["message"]
            assert ".cc" not in error["message"]  # gloo's message (a file path) stays in the log
        wait_for(
            lambda: health(live.url).status_code == 503, 5 - (time.monotonic() - killed), "503"
        )
    llm.close()


# --- the `pypto serve` process: SIGTERM, start-up failures --------------------------------


@contextmanager
def pypto_serve(model: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[tuple]:
    """`pypto serve` in a child process; yields (process, url) once it is healthy."""
    port = free_port()
    argv = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(model)]
    argv += ["--port", str(port), "--dtype", "float32", "--enforce-eager"]
    argv += ["--num-kv-pages", str(FAST_KNOBS["num_kv_pages"])]
    argv += ["--page-size", str(FAST_KNOBS["page_size"]), *flags]
    process = subprocess.Popen(
        argv, stderr=subprocess.PIPE, text=True, env=os.environ | (env or {})
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: serving_at(url) or process.poll() is not None, 120, "the server started")
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def serving_at(url: str) -> bool:
    try:
        return health(url).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits_0(tiny_model):
    with pypto_serve(tiny_model(MODEL)) as (process, url):
        stream = start_stream(url, None, max_tokens=LONG)
        wait_for(lambda: tokens_of(stream) >= 2, 30, "the stream started")
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: health(url).status_code == 503, 5, "/health 503 while draining")
        r = completion(url, None)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert process.wait(patience(60)) == 0
        assert stream.ended and tokens_of(stream) == LONG and error_of(stream) is None
        assert stream.events[-1] == "[DONE]"


@pytest.mark.slow
def test_sigterm_ends_what_is_left_after_the_shutdown_timeout(tiny_model):
    flags = ("--shutdown-timeout", "1", "--max-num-seqs", "1")
    with pypto_serve(tiny_model(MODEL), *flags) as (process, url):
        streams = [start_stream(url, None, max_tokens=LONG) for _ in range(4)]
        wait_for(lambda: tokens_of(streams[0]) + tokens_of(streams[1]) >= 2, 30, "one started")
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert process.wait(patience(30)) == 0
        assert time.monotonic() - signalled < patience(1 + 8)
        wait_for(lambda: all(s.ended for s in streams), 5, "every stream ended")
        ended = [error_of(s) for s in streams]
        assert any(e is not None and e["code"] == "engine_dead" for e in ended)
        assert all(e is None or "shutting down" in e["message"] for e in ended)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (
            ("--dp", "2"),
            fault_env(FAIL_REPLICA_START, "1"),
            "data-parallel replica 1 (pid {}) failed to start: RuntimeError: injected",
        ),
        (("--tp", "2"), fault_env(FAIL_RANK_START, "1"), "rank 1 (pid {}) failed to start"),
        ((), {}, "corrupt safetensors file model.safetensors"),
    ],
    ids=["replica", "rank", "weights"],
)
def test_a_start_up_failure_exits_non_zero_and_leaves_no_process(
    tiny_model, tmp_path, flags, env, message
):
    model = tiny_model(MODEL)
    if not flags:  # bad weights
        model = Path(shutil.copytree(model, tmp_path / "broken"))
        data = (model / "model.safetensors").read_bytes()
        (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pypto_serve(model, *flags, env=env) as (process, _):
        assert process.wait(patience(60)) == 1
        err = process.stderr.read()
    assert "pypto: error:" in err and "Traceback" not in err, err[-2000:]
    # The failing process's own pid, wherever other log lines (a replica that became ready
    # first) name theirs.
    pattern = re.escape(message).replace(re.escape("{}"), r"(\d+)")
    assert re.search(pattern, err), err[-2000:]
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", err)]
    assert all(gone(p) for p in pids)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data_parallel_size", "tensor_parallel_size"])
def test_workers_exit_when_their_busy_parent_is_killed(tiny_model, layout):
    script = textwrap.dedent(
        f"""
        from pypto_serving import LLM, SamplingParams
        llm = LLM({str(tiny_model(MODEL))!r}, {layout}=2, **{FAST_KNOBS!r})
        workers = getattr(llm.engine, "replicas", None) or llm.engine.workers
        print(*[w.pid for w in workers], flush=True)
        params = SamplingParams(max_tokens={LONG}, ignore_eos=True)
        while True:
            llm.generate([{PROMPT!r}] * 8, params, use_tqdm=False)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert pids
        time.sleep(1.0)  # mid-generation
        parent.kill()
        parent.wait()
        wait_for(lambda: all(gone(p) for p in pids), 5, "every worker exited")
    finally:
        parent.kill()
