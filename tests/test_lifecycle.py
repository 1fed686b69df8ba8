"""An engine's life in one process: start-up checks and limits, and what closing releases.

Ground truth: HF transformers' greedy tokens for every engine, one after another.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from checkpoints import hf_greedy
from fault_injection import HANG_RANK_START, inject
from live_server import tiny_llm
from parallel_checks import children_of, gone
from patience import patience

from pypto_serving.errors import PyptoError
from pypto_serving.models.config import read_model_config
from pypto_serving.sampling import SamplingParams

MODEL = "llama-gqa4-tied"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[(11 * i + 5 * j) % 300 + 3 for j in range(4 + 13 * i)] for i in range(3)]
IDLE_LIMIT_S = 8.0
"""A start-up limit the first engine idles past (a tiny eager TP=2 engine starts in ~5 s on
an idle machine; stretched by patience() for a loaded one)."""


def test_a_live_engine_keeps_its_start_up_out_of_the_collector(tiny_model):
    """What start-up made is frozen (gc.freeze): a full collection while the engine serves
    walks none of it (with the default model's engine it walked 433 k objects, 222 ms, a
    stall wherever Python's collector starts one between steps); closing gives it back."""
    gc.unfreeze()
    with tiny_llm(tiny_model(MODEL)) as llm:
        assert gc.get_freeze_count() > 10_000
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert len(gc.get_objects()) < gc.get_freeze_count() // 10
    assert gc.get_freeze_count() == 0


def test_a_model_without_tokenizer_files_is_a_clear_start_up_error(tiny_model, tmp_path, capsys):
    """transformers builds an empty tokenizer for a Qwen directory without tokenizer files;
    the engine must refuse it at start-up, naming the files, not fail later on 'empty prompt'."""
    from pypto_serving.cli import main

    path = tmp_path / "no-tokenizer"
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model("qwen3-hd32-gqa4") / name, path / name)
    message = (
        f"cannot load the tokenizer in {path}: it has no tokenizer files (one of tokenizer.json"
    )
    with pytest.raises(PyptoError, match=re.escape(message)):
        tiny_llm(path)
    assert main(["generate", "--model", str(path), "--prompt", "hi"]) == 1
    out, err = capsys.readouterr()
    assert f"pypto: error: {message}" in err and "Traceback" not in err and out == ""


def test_closed_multi_rank_engines_let_the_next_one_start(tiny_model):
    """Closing an engine (close(), a `with` block, garbage collection) leaves its process
    group and stops its ranks and threads, so the next one starts: TP, PP, TP in turn, the
    last collected as garbage (it leaves nothing behind either). The first also idles past
    its start-up limit, which must not bound the ranks' wait for the next step; a second
    engine while one is open is refused at once."""
    from transformers import AutoModelForCausalLM

    path = tiny_model(MODEL)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    before = set(threading.enumerate())

    def generates(llm) -> bool:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return [r.outputs[0].token_ids for r in outputs] == expected

    def released(pids: list[int]) -> None:
        assert not dist.is_initialized()
        assert all(gone(pid) for pid in pids) and children_of(os.getpid()) == []
        for t in set(threading.enumerate()) - before:
            if t.name.startswith("pypto"):
                t.join(patience(10))
                assert not t.is_alive(), t.name

    idle_limit, started = patience(IDLE_LIMIT_S), time.monotonic()
    llm = tiny_llm(path, tensor_parallel_size=2, startup_timeout_s=idle_limit)
    pids = [w.pid for w in llm.engine.workers]
    assert generates(llm)
    time.sleep(max(started + idle_limit + 1 - time.monotonic(), 0))  # past the limit
    assert generates(llm)
    with pytest.raises(PyptoError, match="still holds another multi-rank engine"):
        tiny_llm(path, pipeline_parallel_size=2)  # at once, not after a rendezvous timeout
    assert generates(llm)
    llm.close()
    released(pids)

    with tiny_llm(path, pipeline_parallel_size=2) as llm:
        pids = [w.pid for w in llm.engine.workers]
        assert generates(llm)
    released(pids)

    llm = tiny_llm(path, tensor_parallel_size=2)
    pids = [w.pid for w in llm.engine.workers]
    assert generates(llm)
    del llm
    gc.collect()
    released(pids)


def test_a_rank_that_hangs_while_starting_fails_start_up_naming_it(tiny_model, monkeypatch):
    inject(monkeypatch, HANG_RANK_START, "1")
    limit, started = patience(6), time.monotonic()
    with pytest.raises(PyptoError) as e:
        tiny_llm(tiny_model(MODEL), tensor_parallel_size=2, startup_timeout_s=limit)
    assert time.monotonic() - started >= limit
    message = str(e.value)
    late = rf"rank 1 \(pid \d+\) did not start within startup_timeout_s \({limit:g} s\)"
    assert re.search(late, message), message
    pids = [int(p) for p in re.findall(r"pid (\d+)", message)]
    assert pids and all(gone(pid) for pid in pids)
    assert children_of(os.getpid()) == [] and not dist.is_initialized()


CHILD = """
import pickle, sys
from pathlib import Path
from pypto_serving.models.config import load_model_config, remember_model_config
path, read = pickle.loads(Path(sys.argv[1]).read_bytes())
remember_model_config(path, read)
cfg = load_model_config(path)
print(cfg == read[1], "transformers" in sys.modules)
"""


def test_a_child_process_takes_its_parents_reading_of_the_config(tiny_model, tmp_path):
    """A rank or a replica is handed its parent's reading of config.json (its spec): it gets
    the same config without importing transformers (~3 s of its start); a config.json
    changed since is read anew, by transformers."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model(MODEL), path)
    handed = tmp_path / "read.pickle"
    handed.write_bytes(pickle.dumps((path, read_model_config(path))))

    def child() -> str:
        run = [sys.executable, "-c", CHILD, str(handed)]
        return subprocess.run(run, capture_output=True, text=True, check=True).stdout.strip()

    assert child() == "True False"
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-3}))
    assert child() == "False True"
