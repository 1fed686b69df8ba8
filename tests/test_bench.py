"""`pypto bench offline|latency` on a tiny model: sane JSON, exact token counts, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pypto_serving.bench.datasets import random_prompts, sampling_vocab
from pypto_serving.cli import main

# small KV pool, no torch.compile: each run takes seconds
FAST = ["--enforce-eager", "--dtype", "float32", "--num-kv-pages", "16", "--page-size", "16"]


def bench(kind: str, model: Path, out: Path, *flags: str) -> dict:
    code = main(["bench", kind, "--model", str(model), "--json", str(out), *FAST, *flags])
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("compile_flags", [(), ("--no-enforce-eager", "--background-compile")])
def test_offline_random(tiny_model, tmp_path, capsys, compile_flags):
    r = bench(
        "offline",
        tiny_model("llama-gqa4-tied"),
        tmp_path / "r.json",
        *("--input-len", "8", "--output-len", "4", "--num-prompts", "3", *compile_flags),
    )
    assert r["engine"]["background_compile"] == bool(compile_flags)
    assert (r["num_prompts"], r["prompt_tokens"], r["output_tokens"]) == (3, 24, 12)
    assert r["mean_prompt_len"] == 8
    for key in ("requests_per_s", "output_tok_per_s", "total_tok_per_s", "elapsed_s"):
        assert r[key] > 0
    assert r["total_tok_per_s"] == pytest.approx(r["output_tok_per_s"] * 3)
    assert r["startup_s"] > 0 and r["peak_rss_mib"] > 10
    assert r["engine"]["dtype"] == "float32"
    assert r["engine"]["enforce_eager"] == (not compile_flags)
    out = capsys.readouterr().out
    assert "output tok/s" in out and "peak RSS (MiB)" in out


def test_offline_prompts_file_takes_the_first_prompts(tiny_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello world"}\n{"prompt": "the quick fox"}\n{"prompt": "x"}\n')
    r = bench(
        "offline",
        tiny_model("llama-gqa4-tied"),
        tmp_path / "r.json",
        *("--prompts-file", str(prompts), "--num-prompts", "2", "--output-len", "3"),
    )
    assert (r["num_prompts"], r["output_tokens"], r["dataset"]) == (2, 6, str(prompts))
    assert r["prompt_tokens"] >= 2 and r["output_tok_per_s"] > 0


@pytest.mark.parametrize("compile_flags", [(), ("--no-enforce-eager", "--background-compile")])
def test_latency(tiny_model, tmp_path, capsys, compile_flags):
    """Eager, and compiled in the background: the timed requests wait for the graphs."""
    r = bench(
        "latency",
        tiny_model("llama-gqa4-tied"),
        tmp_path / "r.json",
        *("--input-len", "6", "--output-len", "5", "--iters", "2", *compile_flags),
    )
    assert r["engine"]["enforce_eager"] == (not compile_flags)
    assert r["engine"]["background_compile"] == bool(compile_flags)
    assert (r["input_len"], r["output_len"], r["iters"]) == (6, 5, 2)
    assert len(r["ttft_ms_all"]) == 2 and len(r["decode_tok_per_s_all"]) == 2
    assert r["ttft_ms"] > 0 and r["decode_tok_per_s"] > 0 and r["tpot_ms"] > 0
    assert r["e2e_s"] * 1000 > r["ttft_ms"] and r["startup_s"] > 0
    assert r["first_token_s"] > r["startup_s"]
    assert "TTFT median (ms)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["offline", "--prompts-file", "/nonexistent/p.jsonl"], "prompts file not found"),
        (["offline", "--prompts-file", "{file}", "--num-prompts", "5"], "has only 1 prompts"),
        (["offline", "--prompts-file", "{file}", "--input-len", "8"], "--input-len applies"),
        (["latency", "--output-len", "1"], "--output-len must be >= 2"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, capsys, argv, message):
    (tmp_path / "p.txt").write_text("one prompt\n")
    argv = [a.replace("{file}", str(tmp_path / "p.txt")) for a in argv]
    code = main(["bench", *argv, "--model", str(tmp_path / "no-model")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("pypto: error:") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["offline", "--output-len", "0"],
        ["offline", "--num-prompts", "x"],
        ["offline", "--dataset", "sharegpt"],
        ["latency", "--iters", "0"],
        [],
    ],
)
def test_malformed_flags_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2 and "usage:" in capsys.readouterr().err


def test_random_prompts_are_reproducible_and_avoid_special_tokens(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model("llama-gqa4-tied")))
    vocab = sampling_vocab(tokenizer, 320)
    assert not set(vocab) & set(tokenizer.all_special_ids) and len(vocab) > 300
    a = random_prompts(vocab, 3, 10, seed=7)
    assert a == random_prompts(vocab, 3, 10, seed=7) != random_prompts(vocab, 3, 10, seed=8)
    assert [len(p) for p in a] == [10, 10, 10]


PROBE = """
import resource
from pypto_serving.bench import peak_rss_mib
print(peak_rss_mib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""

PARENT = """
import subprocess, sys
held = bytearray(1536 << 20)  # 1.5 GiB, touched
del held
run = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True, text=True)
sys.stdout.write(run.stdout + run.stderr)
"""


def test_peak_rss_is_the_process_own_not_a_parents_before_exec():
    """A bench run started by a process that once held much more (side_by_side.py after
    converting a GGUF file) reports its own peak: getrusage's ru_maxrss carries the parent's
    over fork and exec, VmHWM does not."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", PARENT, PROBE], capture_output=True, text=True, check=True
    ).stdout
    own, rusage = map(float, out.split())
    assert rusage > 1536  # the quirk the bench steps around
    assert 10 < own < 1200, own  # the interpreter with torch imported, not the parent's 1.5 GiB
