"""What serving a model takes from beside its weights: the chat template (the tokenizer's, or
vLLM's --chat-template) and the sampling defaults of its generation_config.json (vLLM's
--generation-config)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pypto_serving.errors import PyptoError
from pypto_serving.sampling import SamplingParams

GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json's keys vLLM applies -> SamplingParams' names."""


def chat_template_text(value: str) -> str:
    """--chat-template's template: the file it names, or the value itself where it is a
    Jinja template."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            message = f"cannot read the chat template {value!r}: {e}"
            raise PyptoError(message, "chat_template") from None
    if "{{" in value or "{%" in value:
        return value
    raise PyptoError(
        f"chat_template {value!r} is neither a file nor a Jinja template (no such file, and "
        "no {{ or {% in it)",
        "chat_template",
    )


def generation_defaults(source: str, model_dir: Path) -> dict[str, Any]:
    """The sampling defaults --generation-config gives (SamplingParams' names): none for
    `vllm`, the model directory's generation_config.json for `auto` (none where it has
    none), else the generation_config.json of the directory named."""
    if source == "vllm":
        return {}
    if source == "auto":
        file = model_dir / "generation_config.json"
        if not model_dir.is_dir() or not file.is_file():
            return {}
    else:
        file = Path(source).expanduser() / "generation_config.json"
        if not file.is_file():
            raise PyptoError(
                f"generation_config {source!r} holds no generation_config.json: give auto (the "
                "model's), vllm (none) or a directory holding one",
                "generation_config",
            )
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise PyptoError(f"cannot read {file}: {e}", "generation_config") from None
    if not isinstance(data, dict):
        raise PyptoError(f"{file} is not a JSON object", "generation_config")
    out = {ours: data[key] for key, ours in GENERATION_KEYS.items() if data.get(key) is not None}
    try:
        SamplingParams(**out)
    except (PyptoError, TypeError) as e:
        raise PyptoError(f"{file}: {e}", "generation_config") from None
    return out
