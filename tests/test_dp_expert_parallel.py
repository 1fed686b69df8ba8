"""DP attention + EP: `--dp N --enable-expert-parallel` on a mixture-of-experts model runs N
replicas (each its own scheduler, KV and prefix cache) whose MoE layers form one
expert-parallel group over torch.distributed (gloo here), stepping together.

Ground truth: HF transformers and the single engine without EP; greedy tokens must not change
whichever replica computes a request, whichever transport (all_to_all,
allgather_reducescatter) carries its tokens to their experts, and while the other replica has
no request (it joins the MoE exchanges with no tokens)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import hf_greedy
from live_server import free_port, tiny_llm
from moe_exchange import ACTIVATIONS, CASES
from parallel_checks import children_of, config_error, gone
from patience import patience, wait_for

from pypto_serving.cli import main
from pypto_serving.distributed import Group, resolve_groups
from pypto_serving.engine.dp import DPEngine, ReplicaDiedError
from pypto_serving.errors import PyptoError, RequestFailedError
from pypto_serving.ops.moe import column_owners, expert_owners, expert_placement
from pypto_serving.sampling import SamplingParams

QWEN_MOE, DEEPSEEK = "qwen3moe-e4-top2", "deepseekv3-qlora-yarn"
V4, QWEN_E8 = "deepseekv4-swa-csa-hca-hash", "qwen3moe-e8-kv4"
PROMPTS = [[(11 * i + 5 * j) % 300 + 3 for j in range(4 + 13 * i)] for i in range(6)]
LENGTHS = [12, 3, 9, 5, 12, 2]
"""Each prompt's max_tokens: the replicas' requests end at different steps."""


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def dp_ep(path: Path, **knobs: object):
    return tiny_llm(path, data_parallel_size=2, enable_expert_parallel=True, **knobs)


def tokens(llm, prompts=PROMPTS, lengths=LENGTHS) -> list[list[int]]:
    out = llm.generate(prompts, [params(n) for n in lengths], use_tqdm=False)
    return [r.outputs[0].token_ids for r in out]


@pytest.fixture(scope="module")
def hf_tokens(tiny_model):
    """HF's greedy tokens for PROMPTS (LENGTHS of them), per checkpoint."""
    from transformers import AutoModelForCausalLM

    made: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in made:
            hf = AutoModelForCausalLM.from_pretrained(tiny_model(name), dtype=torch.float32)
            made[name] = [hf_greedy(hf.eval(), p, n) for p, n in zip(PROMPTS, LENGTHS, strict=True)]
        return made[name]

    return get


def check_replicas(engine: DPEngine, num_experts: int, strategy: str) -> None:
    """Each replica knows its DP rank and size, its EP group is the replicas, and it holds
    the experts the placement gives its rank."""
    assert engine.lockstep
    for i, replica in enumerate(engine.replicas):
        info = replica.info
        assert info is not None
        assert info.groups.dp == info.groups.ep == Group(i, 2)
        assert info.groups.tp == info.groups.pp == Group()
        assert info.experts == [expert_placement(num_experts, i, 2, strategy)]


def check_alone(llm, prompt: list[int], expected: list[int]) -> None:
    """One request alone: one replica computes it, the other (no request) joins every MoE
    exchange with no tokens of its own."""
    engine = llm.engine
    before = [s.generation_tokens for s in engine._stats]
    assert tokens(llm, [prompt], [len(expected)]) == [expected]
    gained = [s.generation_tokens - b for s, b in zip(engine._stats, before, strict=True)]
    assert sorted(gained) == [0, len(expected)], gained


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "backend", "eager"),
    [("linear", "all_to_all", True), ("round_robin", "allgather_reducescatter", False)],
)
def test_dp2_ep_qwen3_moe_gives_the_single_engine_and_hf_tokens(
    tiny_model, hf_tokens, strategy, backend, eager
):
    """Eagerly, and compiled (the exchange an opaque op in each layer's graph: the replicas'
    warm-up steps are collective, and nothing compiles after them)."""
    path = tiny_model(QWEN_MOE)
    expected = hf_tokens(QWEN_MOE)
    with tiny_llm(path) as one:
        assert tokens(one) == expected
    knobs = {"expert_placement_strategy": strategy, "all2all_backend": backend}
    with dp_ep(path, enforce_eager=eager, **knobs) as llm:
        engine = llm.engine
        assert isinstance(engine, DPEngine)
        pids = [r.pid for r in engine.replicas]
        check_replicas(engine, 4, strategy)
        assert tokens(llm) == expected
        assert all(s.generation_tokens > 0 for s in engine._stats)  # both computed requests
        check_alone(llm, PROMPTS[3], expected[3])
        assert engine.router.pending == [0, 0]
        assert engine.stats().num_recompilations == 0
        # a step's time includes waits for the other replica: no layer cost is learnt from it
        assert engine.stats().layer_costs == (0.0, 0.0)
    assert all(gone(pid) for pid in pids)


@pytest.mark.slow
def test_dp2_ep_deepseek_v3_gives_the_hf_tokens(tiny_model, hf_tokens):
    """MLA attention per replica, grouped routing, shared experts beside the routed ones."""
    expected = hf_tokens(DEEPSEEK)
    with dp_ep(tiny_model(DEEPSEEK), expert_placement_strategy="round_robin") as llm:
        check_replicas(llm.engine, 8, "round_robin")
        assert tokens(llm) == expected
        check_alone(llm, PROMPTS[4], expected[4])


@pytest.mark.slow
def test_dp2_ep_deepseek_v4_gives_the_hf_tokens(tiny_model, hf_tokens):
    """DeepSeek-V4: each replica its own compressed KV (window rows and entry pages), hash
    and scored routing, clamped experts, the shared expert beside them."""
    expected = hf_tokens(V4)
    with dp_ep(tiny_model(V4), page_size=8) as llm:
        check_replicas(llm.engine, 4, "linear")
        assert tokens(llm) == expected
        check_alone(llm, PROMPTS[5], expected[5])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "backend", "strategy"),
    [
        (QWEN_MOE, "pypto_default", "linear"),
        (QWEN_E8, "allgather_reducescatter", "round_robin"),
        (V4, "pypto_default", "linear"),
    ],
)
def test_dp2_tp2_ep_gives_the_hf_tokens(tiny_model, hf_tokens, name, backend, strategy):
    """Two replicas of two TP ranks each, the experts over the 4 ranks (replica-major), each
    rank holding those its placement gives it: each TP rank exchanges tokens with the other
    replica's rank of its TP index for the experts held there, and each replica all-reduces
    its ranks' sums; a replica with no request joins the exchange with all its ranks.
    DeepSeek-V4: its heads and output groups split over each replica's TP ranks, its
    compressed KV whole on each."""
    path = tiny_model(name)
    expected = hf_tokens(name)
    knobs = {"all2all_backend": backend, "expert_placement_strategy": strategy}
    with dp_ep(path, tensor_parallel_size=2, **knobs) as llm:
        engine = llm.engine
        for i, replica in enumerate(engine.replicas):
            info = replica.info
            assert info is not None
            assert (info.groups.dp, info.groups.tp) == (Group(i, 2), Group(0, 2))
            assert info.groups.ep == Group(2 * i, 4)  # its rank 0's place
            n = 8 if name == QWEN_E8 else 4
            assert info.experts == [expert_placement(n, 2 * i + t, 4, strategy) for t in (0, 1)]
        assert tokens(llm) == expected
        check_alone(llm, PROMPTS[3], expected[3])


def test_every_rank_of_replicas_x_tp_holds_its_experts_once():
    """DP 2 x TP 4 + EP: the expert group is the 8 ranks, replica-major; each TP rank's
    exchange reaches its column's experts, and every expert is reached by exactly one
    column in each replica."""
    for strategy in ("linear", "round_robin"):
        held = []
        for r in range(2):
            for t in range(4):
                g = resolve_groups(t, 4, 1, True, strategy, Group(r, 2), "all_to_all")
                assert (g.ep, g.expert_exchange) == (Group(r * 4 + t, 8), "all_to_all")
                held.append(expert_placement(8, g.ep.rank, 8, strategy))
                owners = column_owners(expert_owners(8, 8, strategy), t, 4)
                column = {e: 0 for e in expert_placement(8, t, 8, strategy)}
                column |= {e: 1 for e in expert_placement(8, 4 + t, 8, strategy)}
                assert {e: o for e, o in enumerate(owners) if o >= 0} == column
        assert sorted(e for h in held for e in h) == list(range(8))


NOTE = {  # the founding parallel-strategy note's example, verbatim
    "parallel": {
        "data_parallel_size": 2,
        "tensor_parallel_size": 4,
        "pipeline_parallel_size": 1,
        "enable_expert_parallel": True,
        "expert_placement_strategy": "linear",
        "all2all_backend": "pypto_default",
        "data_parallel_backend": "local",
        "data_parallel_load_balance": "internal",
    }
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [DEEPSEEK, "deepseekv4-split8"])
def test_the_parallel_strategy_notes_example_serves_deepseek(tiny_model, hf_tokens, name):
    """2 replicas x 4 TP ranks, the 8 routed experts over the 8 ranks: MLA's heads (V4's
    heads and output groups) split 4 ways in each replica, the shared experts by columns,
    greedy tokens equal to HF's."""
    expected = hf_tokens(name)
    with tiny_llm(tiny_model(name), **NOTE["parallel"]) as llm:
        for i, replica in enumerate(llm.engine.replicas):
            info = replica.info
            assert info is not None and info.groups.ep == Group(4 * i, 8)
            assert info.experts == [[4 * i + t] for t in range(4)]  # each TP rank's, linear
        assert tokens(llm) == expected
        check_alone(llm, PROMPTS[4], expected[4])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flags", "note"])
def test_pypto_serve_dp2_ep_answers_the_single_engine_text(tiny_model, tmp_path, how):
    """`pypto serve --dp 2 --enable-expert-parallel` as users start it, and `pypto serve
    --config` with the parallel-strategy note's JSON verbatim (2 replicas x 4 TP ranks, 8
    experts over the 8 ranks): concurrent requests of different lengths, then one alone, each
    the text of the single engine."""
    path = tiny_model(QWEN_MOE if how == "flags" else QWEN_E8)
    with tiny_llm(path) as one:
        out = one.generate(PROMPTS, [params(n) for n in LENGTHS], use_tqdm=False)
        expected = [r.outputs[0].text for r in out]
    port = free_port()
    argv = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", str(path)]
    argv += ["--port", str(port), "--dtype", "float32", "--enforce-eager", "--page-size", "16"]
    argv += ["--served-model-name", "tiny"]
    if how == "flags":
        argv += ["--dp", "2", "--enable-expert-parallel"]
    else:
        (tmp_path / "note.json").write_text(json.dumps(NOTE))
        argv += ["--config", str(tmp_path / "note.json")]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return process.poll() is not None

    def complete(i: int) -> str:
        body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": LENGTHS[i]}
        body |= {"temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=patience(120))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    try:
        wait_for(up, 120, "the server started")
        assert process.poll() is None, process.communicate()[1][-2000:]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert list(pool.map(complete, range(len(PROMPTS)))) == expected
        assert complete(2) == expected[2]
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=patience(30))
            except subprocess.TimeoutExpired:
                process.kill()
        process.wait()
    assert process.returncode == 0, process.stderr.read()[-2000:] if process.stderr else ""


@pytest.mark.slow
def test_a_lost_replica_stops_its_expert_parallel_group(tiny_model):
    """The others' MoE layers cannot go on without its experts: every replica is lost."""
    llm = dp_ep(tiny_model(QWEN_MOE))
    pids = [r.pid for r in llm.engine.replicas]
    try:
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises((ReplicaDiedError, RequestFailedError)):
            tokens(llm)
        assert set(llm.engine.lost) == {0, 1}
        assert "expert-parallel group" in llm.engine.lost[0]
        wait_for(lambda: all(gone(pid) for pid in pids), 10, "the replicas stopped")
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"enable_expert_parallel": True}, "or data_parallel_size > 1"),
        (
            {"data_parallel_size": 2, "pipeline_parallel_size": 2, "enable_expert_parallel": True},
            "(DP attention + EP) needs pipeline_parallel_size 1",
        ),
        (
            {
                "data_parallel_size": 2,
                "tensor_parallel_size": 2,
                "enable_expert_parallel": True,
                "nnodes": 2,
                "master_port": 29500,
            },
            "tensor_parallel_size > 1 spans one machine for now (nnodes is 2)",
        ),
        ({"all2all_backend": "pplx"}, "all2all_backend must be one of pypto_default, all_to_all"),
        ({"data_parallel_backend": "ray"}, "data_parallel_backend must be 'mp' (each replica"),
        (
            {
                "data_parallel_backend": "local",
                "data_parallel_size": 2,
                "nnodes": 2,
                "master_port": 29500,
            },
            "data_parallel_backend 'local' keeps every replica on this machine, but nnodes is 2",
        ),
    ],
)
def test_config_errors(knobs, message):
    assert message in config_error(knobs)


def test_the_parallel_strategy_notes_spellings_have_their_meanings():
    """The founding note's example spells the exchange, the replicas' kind and the router's
    policy its own way: each is accepted and means the project's default."""
    from pypto_serving.config import engine_config

    note = {
        "all2all_backend": "pypto_default",
        "data_parallel_backend": "local",
        "data_parallel_load_balance": "internal",
    }
    p = engine_config(data_parallel_size=2, **note).parallel
    assert (p.all2all_exchange, p.load_balance_policy) == ("all_to_all", "least_pending_tokens")
    assert engine_config().parallel.all2all_exchange == "all_to_all"  # the default is the same
    spelled = engine_config(
        all2all_backend="allgather_reducescatter", data_parallel_load_balance="round_robin"
    ).parallel
    assert (spelled.all2all_exchange, spelled.load_balance_policy) == (
        "allgather_reducescatter",
        "round_robin",
    )


def test_a_moe_under_dp_and_tp_without_ep_is_refused_before_any_replica_starts(tiny_model):
    with pytest.raises(PyptoError, match="under tensor parallelism needs enable_expert_parallel"):
        tiny_llm(tiny_model(QWEN_MOE), data_parallel_size=2, tensor_parallel_size=2)
    assert children_of(os.getpid()) == []


def test_a_dense_model_is_refused_before_any_replica_starts(tiny_model):
    with pytest.raises(PyptoError, match=r"needs a mixture-of-experts model; .* is dense"):
        dp_ep(tiny_model("qwen2-gqa2"))
    assert children_of(os.getpid()) == []


def test_the_cli_refuses_an_unknown_data_parallel_backend(tiny_model, capsys):
    argv = ["generate", "--model", str(tiny_model(QWEN_MOE)), "--prompt", "hi", "--dp", "2"]
    argv += ["--enable-expert-parallel", "--data-parallel-backend", "ray"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1 and "data_parallel_backend must be 'mp'" in err and "Traceback" not in err


def test_groups_place_the_experts_over_the_replicas():
    dp = Group(1, 2)
    g = resolve_groups(0, 1, 1, True, "round_robin", dp, "allgather_reducescatter")
    assert (g.dp, g.ep, g.tp) == (dp, dp, Group())
    assert g.expert_exchange == "allgather_reducescatter" and g.world_size == 1
    tp = resolve_groups(1, 2, 1, True)  # EP over the TP ranks: every rank has every token
    assert tp.ep == tp.tp == Group(1, 2) and tp.expert_exchange == "all_reduce"
    assert resolve_groups(0, 1, 1, False, dp=dp).expert_exchange == "none"
    for strategy in ("linear", "round_robin"):
        owners = expert_owners(8, 3, strategy)
        for rank in range(3):
            assert [e for e in range(8) if owners[e] == rank] == expert_placement(
                8, rank, 3, strategy
            )


@pytest.mark.slow
def test_the_exchange_equals_every_expert_on_one_rank(tmp_path):
    """Both transports and both activations (gpt-oss's with the experts' biases), with rank 1
    idle (no tokens) and with tokens on both ranks: each token's expert outputs as one rank
    holding every expert computes them (up to the rounding of the experts' matmuls over other
    row counts)."""
    script = Path(__file__).with_name("moe_exchange.py")
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo"}
    argv = [[sys.executable, str(script), str(r), str(tmp_path / "store")] for r in range(2)]
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, text=True, env=env) for a in argv]
    outs = [p.communicate(timeout=patience(120))[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    got = [json.loads(line) for out in outs for line in out.splitlines()]
    assert len(got) == 2 * 2 * len(ACTIVATIONS) * len(CASES)
    assert all(same_shape and diff < 1e-5 for *_, same_shape, diff in got), got
