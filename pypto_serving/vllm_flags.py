"""`vllm serve` flags that have no config field here: the ones this hardware and design make
needless (accepted, each saying why) and the features this server does not have (refused
when given, each naming what to do instead). The flags that do mean something here are
config fields (config.py), as every knob is.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

NEEDLESS = {
    "enable-chunked-prefill": "prompts are always computed in chunks of max_num_batched_tokens",
    "enable-prompt-tokens-details": "usage always carries prompt_tokens_details.cached_tokens",
}
"""Flags accepted with no effect: what they turn on is how this server always works."""

OUT_OF_SCOPE = {
    "enable-prompt-embeds": "prompt embeddings as input are not supported; send text or token ids",
    "limit-mm-per-prompt": "images, audio and video inputs are not supported (text models only)",
    "chat-template-content-format": "message content is always given to the chat template "
    "as a string (text parts joined)",
    "lora-modules": "LoRA adapters are not supported; serve a checkpoint with the adapter "
    "merged (peft's merge_and_unload)",
    "max-lora-rank": "LoRA adapters are not supported",
    "max-cpu-loras": "LoRA adapters are not supported",
    "reasoning-config": "reasoning budgets are not supported",
    "tool-server": "built-in tool servers (MCP, browsing, code) are not supported; give "
    "tools in the request and run them in the client",
    "attention-backend": "attention kernels are chosen by the run plan (see "
    "--native-attention and --native-decode)",
    "async-scheduling": "scheduling is not overlapped with the step here",
    "no-async-scheduling": "scheduling is not overlapped with the step here (already so)",
    "load-format": "the loader reads safetensors directories and GGUF files, by what the "
    "model path holds",
    "skip-tokenizer-init": "the tokenizer is always loaded (it renders and detokenizes here)",
    "watermark-config": "watermarking is not supported",
    "hf-overrides": "edit the model directory's config.json instead",
}
"""vLLM flags for features this server does not have: refused, saying so."""


class Refused(argparse.Action):
    """Fails the command line with the flag's reason, whatever follows it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        raise argparse.ArgumentError(self, f"not supported: {self.help}")


def add_vllm_only_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM's flags with nothing to set here")
    for name, why in NEEDLESS.items():
        group.add_argument(
            f"--{name}", dest=f"vllm_{name}", action="store_true", help=f"accepted: {why}"
        )
    for name, why in OUT_OF_SCOPE.items():
        group.add_argument(
            f"--{name}", dest=f"vllm_{name}", action=Refused, nargs="?", help=why, metavar="X"
        )
