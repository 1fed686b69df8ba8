"""`pypto generate`: output on stdout only, and clear errors (no tracebacks) for bad input."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys

import pytest
import torch
from patience import patience

from pypto_serving import LLM
from pypto_serving.cli import build_parser, main
from pypto_serving.device import resolve_dtype
from pypto_serving.errors import PyptoError
from pypto_serving.vllm_flags import OUT_OF_SCOPE


def run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def tokenizer_of(path):
    from pypto_serving.models.loader import load_tokenizer

    return load_tokenizer(path)


def test_generate_streams_text_only_to_stdout(tiny_model):
    path = tiny_model("qwen3-hd32-gqa4")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pypto_serving.cli",
            "generate",
            "--model",
            str(path),
            "--prompt",
            "hello world",
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--dtype",
            "float32",
            "--enforce-eager",  # what goes where is the question, not the compile's
        ],
        capture_output=True,
        text=True,
        timeout=patience(120),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "engine ready" in proc.stderr and "engine ready" not in proc.stdout
    assert proc.stdout.endswith("\n") and "Traceback" not in proc.stderr
    # the timing line, on stderr only (as llama.cpp prints one): the prompt's tokens, the
    # tokens generated (12, or fewer if EOS came), the first text's time and the rate
    timing = re.search(
        r"\[(\d+) prompt tokens, (\d+) generated in [\d.]+ s, first text after \d+ ms: "
        r"[\d.]+ tokens/s\]",
        proc.stderr,
    )
    assert timing is not None and "generated in" not in proc.stdout, proc.stderr[-500:]
    prompt = tokenizer_of(path).encode("hello world")
    assert int(timing[1]) == len(prompt) and 1 <= int(timing[2]) <= 12


def test_prompts_file_writes_jsonl(tiny_model, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "the quick fox"}\n')
    out = tmp_path / "out.jsonl"
    code, _, err = run(
        [
            "generate",
            "--model",
            str(tiny_model("llama-gqa4-tied")),
            "--prompts-file",
            str(prompts),
            "--output",
            str(out),
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--chat",
        ],
        capsys,
    )
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["hello", "the quick fox"]
    generated = sum(len(r["token_ids"]) for r in rows)
    assert "[2 prompts, " in err and f"{generated} generated in" in err
    assert all(r["finish_reason"] in ("stop", "length") and r["token_ids"] for r in rows)


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("missing_dir", "model path not found"),
        ("no_config", "missing config.json"),
        ("no_weights", "no *.safetensors weight files"),
        ("corrupt_weights", "corrupt safetensors file model.safetensors"),
        (
            "arch",
            "unsupported architecture GPT2LMHeadModel; supported: LlamaForCausalLM, "
            "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
        ),
        ("bad_json", "config.json in"),
        ("no_tokenizer", "cannot load the tokenizer"),
    ],
)
def test_bad_model_gives_clear_error(tiny_model, tmp_path, capsys, breakage, message):
    path = copy_model(tiny_model("llama-gqa4-tied"), tmp_path / "m")
    if breakage == "missing_dir":
        path = tmp_path / "nope"
    elif breakage == "no_config":
        (path / "config.json").unlink()
    elif breakage == "no_weights":
        (path / "model.safetensors").unlink()
    elif breakage == "corrupt_weights":
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif breakage == "arch":
        cfg = json.loads((path / "config.json").read_text())
        cfg["architectures"] = ["GPT2LMHeadModel"]
        (path / "config.json").write_text(json.dumps(cfg))
    elif breakage == "bad_json":
        (path / "config.json").write_text("{not json")
    elif breakage == "no_tokenizer":
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (path / f).unlink()
    code, out, err = run(["generate", "--model", str(path), "--prompt", "hi"], capsys)
    assert code == 1
    assert "pypto: error:" in err and message in err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-1"], "invalid temperature=-1.0"),
        (["--top-p", "1.5"], "invalid top_p=1.5: must be in (0, 1]"),
        (["--top-k", "-5"], "invalid top_k=-5"),
        (["--dtype", "int8"], "unsupported dtype 'int8'"),
        (["--executor", "fast"], "executor must be one of"),
        (["--page-size", "0"], "page_size must be an integer >= 1"),
        (["--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
        (["--kv-ssd-dir", "/dev/null/x"], "cannot use kv_ssd_dir /dev/null/x"),
        (["--kv-ssd-dir", "/tmp", "--kv-ssd-bytes", "1KiB"], "kv_ssd_bytes (1024) is less"),
        (["--kv-remote", "localhost:50051"], "kv_remote must look like mooncake://HOST:PORT"),
        (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens must be"),
        (
            ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
            "method 'eagle' (EAGLE heads) is not available yet",
        ),
    ],
)
def test_bad_flag_values_give_clear_error(tiny_model, capsys, flags, message):
    path = tiny_model("llama-gqa4-tied")
    code, out, err = run(["generate", "--model", str(path), "--prompt", "hi", *flags], capsys)
    assert code == 1 and message in err and out == ""


@pytest.mark.parametrize(
    "flags",
    [["--max-tokens", "0"], ["--max-tokens", "x"], ["--bogus"], ["--kv-cpu-bytes", "4 lots"]],
)
def test_malformed_flags_exit_2(capsys, flags):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", *flags])
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_prompt_too_long_for_context(tiny_model, capsys):
    path = tiny_model("llama-gqa4-tied")
    code, _, err = run(
        ["generate", "--model", str(path), "--prompt", "hello " * 50, "--max-model-len", "16"],
        capsys,
    )
    assert code == 1 and "context is 16" in err


def test_a_max_model_len_beyond_the_models_context_is_refused(tiny_model, capsys, caplog):
    """As vLLM refuses it (the tiny models' context is 512 positions); one the KV pages
    cannot hold is lowered, and the log says so."""
    path = tiny_model("llama-gqa4-tied")
    code, out, err = run(
        ["generate", "--model", str(path), "--prompt", "hi", "--max-model-len", "513"], capsys
    )
    assert code == 1 and out == "" and "Traceback" not in err
    assert "max_model_len 513 is longer than the model's context length, 512" in err
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(path), dtype="float32", max_model_len=512, num_kv_pages=4, page_size=16)
    assert llm.engine.max_model_len == 64
    assert "max_model_len 512 lowered to 64: the KV pages hold no longer" in caplog.text


def test_serve_rejects_bad_options_clearly(tmp_path, capsys):
    cases = [
        (["serve", "--config", str(tmp_path / "missing.json")], "config file not found"),
        (["serve", "--port", "70000"], "port must be in [0, 65535]"),
        (["serve", "--max-request-bytes", "10"], "max_request_bytes must be >= 1024"),
        (["serve", "--enable-lora"], "LoRA adapters are not supported; merge the adapter"),
        (["serve", "--uvicorn-log-level", "loud"], "uvicorn_log_level must be one of critical"),
        (["serve", "--tool-call-parser", "granite"], "give one of hermes, llama3_json, mistral"),
    ]
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    cases.append((["serve", "--config", str(bad_json)], "cannot read config file"))
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"server": {"prot": 1}}))
    cases.append((["serve", "--config", str(unknown)], "unknown option(s) prot"))
    wrong_section = tmp_path / "section.json"
    wrong_section.write_text(json.dumps({"cache": 3}))
    cases.append((["serve", "--config", str(wrong_section)], "'cache' must be an object"))
    bad_engine = tmp_path / "engine.json"
    bad_engine.write_text(json.dumps({"cache": {"page_size": 0}, "model": "/nonexistent"}))
    cases.append((["serve", "--config", str(bad_engine)], "page_size must be an integer >= 1"))
    for argv, message in cases:
        code, out, err = run(argv, capsys)
        assert code == 1 and message in err and out == "", (argv, err)


def test_serve_config_file_and_flags(tmp_path, monkeypatch, capsys):
    """The config file gives engine and server options; command-line flags win."""
    from pypto_serving.server import launch

    seen = {}
    monkeypatch.setattr(launch, "run_server", lambda knobs, server: seen.update(k=knobs, s=server))
    config = tmp_path / "c.json"
    config.write_text(
        json.dumps(
            {
                "dtype": "float32",
                "scheduler": {"max_num_seqs": 4},
                "server": {"port": 9001, "api_key": "k"},
            }
        )
    )
    assert main(["serve", "--config", str(config), "--port", "9002", "--page-size", "16"]) is None
    assert seen["k"] == {
        "dtype": "float32",
        "max_num_seqs": 4,
        "page_size": 16,
        "max_num_batched_tokens": 1024,  # serve's own defaults
        "background_compile": True,
    }
    assert (seen["s"].port, seen["s"].api_key, seen["s"].host) == (9002, "k", "127.0.0.1")
    assert seen["s"].served_model_name is None
    config.write_text(json.dumps({"server": {"served_model_name": "smol"}}))  # one name
    assert main(["serve", "--config", str(config)]) is None
    assert seen["s"].served_model_name == ["smol"]
    assert main(["serve", "--served-model-name", "a", "b"]) is None  # vLLM's several names
    assert seen["s"].served_model_name == ["a", "b"]
    for bad in (["a", "a"], [""], []):
        config.write_text(json.dumps({"server": {"served_model_name": bad}}))
        assert main(["serve", "--config", str(config)]) == 1
        assert "served_model_name must be one or more different" in capsys.readouterr().err


def test_vllm_spellings_of_serve_flags(monkeypatch, capsys):
    """vLLM's command lines: flags with underscores, the API key from VLLM_API_KEY, --seed,
    --structured-outputs-config.backend, and flags whose effect is how this server works."""
    from pypto_serving.server import launch

    seen = {}
    monkeypatch.setattr(launch, "run_server", lambda knobs, server: seen.update(k=knobs, s=server))
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    argv = ["serve", "--max_model_len", "64", "--max-num_seqs=3", "--seed", "7"]
    argv += ["--structured-outputs-config.backend", "xgrammar", "--enable-chunked-prefill"]
    argv += ["--enable-prompt-tokens-details", "--root-path", "/llm"]
    assert main(argv) is None
    assert seen["k"]["max_model_len"] == 64 and seen["k"]["max_num_seqs"] == 3
    assert seen["k"]["seed"] == 7
    server = seen["s"]
    assert (server.api_key, server.structured_outputs_backend) == ("from-env", "xgrammar")
    assert server.root_path == "/llm"
    assert resolve_dtype("half", torch.device("cpu")) is torch.float16  # vLLM's spellings
    assert resolve_dtype("float", torch.device("cpu")) is torch.float32
    assert main(["serve", "--api-key", "given"]) is None  # the command line wins
    assert seen["s"].api_key == "given"
    for argv, message in [
        (["serve", "--structured-outputs-config.backend", "regexes"], "each means llguidance"),
        (["serve", "--root-path", "llm/"], "root_path must start with / and not end with one"),
    ]:
        code, _, err = run(argv, capsys)
        assert code == 1 and message in err, err


@pytest.mark.parametrize("name", sorted(OUT_OF_SCOPE))
def test_vllm_flags_for_features_not_here_are_refused_saying_so(name, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", f"--{name}", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --{name}: not supported: {OUT_OF_SCOPE[name]}" in err, err


@pytest.mark.slow
def test_a_server_started_with_vllms_flags_answers(tiny_model):
    """vLLM's serve flags that mean something here, or nothing to turn off: accepted (issue
    45's command line, with --trust-remote-code)."""
    import httpx
    from test_faults import pypto_serve

    flags = ["--gpu-memory-utilization", "0.5", "--disable-log-requests"]
    flags += ["--uvicorn-log-level", "warning", "--enable-auto-tool-choice"]
    flags += ["--tool-call-parser", "hermes", "--served-model-name", "a", "b"]
    flags += ["--trust-remote-code", "--max_model_len", "128", "--seed", "0"]
    flags += ["--enable-chunked-prefill", "--structured-outputs-config.backend", "xgrammar"]
    with pypto_serve(tiny_model("llama-gqa4-tied"), *flags) as (process, url):
        assert process.poll() is None, process.stderr.read()[-2000:]
        for name in ("a", "b"):
            body = {"model": name, "prompt": "hi", "max_tokens": 2}
            r = httpx.post(url + "/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["model"] == name, r.text
    assert "--trust-remote-code is accepted for vLLM's command lines" in process.stderr.read()


def test_gpu_memory_utilization_sizes_the_kv_pool_from_the_memory_available(
    tiny_model, monkeypatch
):
    """The KV pool gets the fraction of the memory available, less the weights (float32
    here), shared by the ranks; too little is an error naming the flag."""
    from pypto_serving.engine import memory_budget
    from pypto_serving.models.loader import checkpoint_numel

    path = tiny_model("llama-gqa4-tied")
    monkeypatch.setattr(memory_budget, "available_memory", lambda device: 1 << 30)
    weights = checkpoint_numel(path) * 4
    knobs = {"dtype": "float32", "enforce_eager": True, "page_size": 16}
    llm = LLM(str(path), gpu_memory_utilization=0.25, **knobs)
    assert llm.engine.config.cache.kv_device_bytes == int(0.25 * (1 << 30) - weights)
    llm.close()
    pinned = LLM(str(path), gpu_memory_utilization=0.25, num_kv_pages=8, **knobs)
    assert pinned.engine.config.cache.kv_device_bytes == 2 << 30  # num_kv_pages wins
    pinned.close()
    monkeypatch.setattr(memory_budget, "available_memory", lambda device: weights)
    with pytest.raises(PyptoError, match=r"gpu_memory_utilization 0\.9 leaves the KV cache"):
        LLM(str(path), gpu_memory_utilization=0.9, **knobs)
    with pytest.raises(PyptoError, match=r"a fraction in \(0, 1\]"):
        LLM(str(path), gpu_memory_utilization=1.5, **knobs)


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("4GiB", 4 << 30), ("1.5 GiB", 3 << 29), ("512MB", 512 * 10**6), ("2k", 2000)],
)
def test_byte_budgets_take_units(text, value):
    from pypto_serving.config import engine_config, parse_bytes

    assert parse_bytes(text) == value
    assert engine_config(kv_cpu_bytes=text).cache.kv_cpu_bytes == value  # JSON configs too
    args = build_parser().parse_args(["serve", "--kv-ssd-bytes", text])
    assert args.kv_ssd_bytes == value
