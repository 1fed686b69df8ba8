"""Convert a llama, qwen3 or qwen3moe GGUF file into a Hugging Face model directory.

The output is what `transformers` writes for a `LlamaForCausalLM` (`Qwen3ForCausalLM`,
`Qwen3MoeForCausalLM`, each expert's matrices apart as their checkpoints hold them): `config.json`,
`generation_config.json`, `model.safetensors` (dequantized, bfloat16 by default) and the tokenizer
files; and beside them `gguf/blocks.safetensors`, the file's Q4_1 and Q8_0 matrices as they are
stored (per HF tensor name, a stack of experts' per expert: its values `.q`, one fp16 `.scale`
per row and 32 inputs, and for Q4_1 a `.min`: weight = q * scale + min), kept when every
matrix the model multiplies by (a MoE's router aside) is one of the two, which
`--quantization gguf` serves without quantizing them again
(models/gguf_weights.py). llama.cpp stores a llama's q/k projections with their rows permuted
(it pairs rotary dimensions differently); that permutation is undone here, in both (qwen3's
are stored as they are: llama.cpp rotates them as HF does). The directory
is built next to its destination and moved into place in one rename, so an interrupted
conversion never leaves a half-written one.
"""

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import SupportsInt, cast
from unittest import mock

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from pypto_serving.errors import ModelLoadError

MARKER_FILE = "pypto_conversion.json"
"""Written last into a converted directory; its presence means the conversion completed."""
BLOCKS_FILE = "gguf/blocks.safetensors"
"""The file's Q4_1 / Q8_0 matrices as stored (values, scales, minimums), by HF tensor name: in
a folder of its own, out of the checkpoint's `*.safetensors`."""
BLOCKS_INDEX = "gguf/blocks.safetensors.index.json"
"""Where the stored parts outgrow one file (SHARD_BYTES): their shards' weight map, HF's way."""
CONVERSION_VERSION = 3
"""In the marker: a conversion older than this is made again (1: no BLOCKS_FILE; 2: a MoE's
experts kept no stored parts)."""
SHARD_BYTES = 2 << 30
"""The most a conversion holds in memory before writing it out: tensors go into one file
where they fit, else into shards of about this size with HF's index (`_Shards`), so that an
8B file (15 GB of bf16 and 8 GB of stored parts) converts on a 24 GiB machine."""

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
"""GGUF architectures converted, and the HF class each becomes."""
_PERMUTED = ("llama",)
"""Architectures whose q/k rows llama.cpp's converter permutes."""
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
"""A MoE layer's experts' matrices, stacked [experts, rows, cols] in a GGUF, each expert's
apart in HF's checkpoints (`model.layers.L.mlp.experts.E.<name>.weight`)."""
_TENSOR_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<name>\w+)\.(?P<kind>weight|bias)")
# llama.cpp pre-tokenizers that split every digit off before the GPT-2 regex; transformers' GGUF
# tokenizer does not know them and would fall back to the plain GPT-2 split.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_LOAD_ARGS = ("is_local", "local_files_only")  # saved into tokenizer_config.json; not settings


def is_converted_dir(path: Path) -> bool:
    """True when `path` holds a complete conversion written by `convert_gguf_to_hf`."""
    weights = ("model.safetensors", "model.safetensors.index.json")
    return all((path / name).is_file() for name in (MARKER_FILE, "config.json")) and any(
        (path / name).is_file() for name in weights
    )


def blocks_files(model_dir: Path) -> list[Path]:
    """The files of a conversion's stored parts: BLOCKS_FILE, or the shards BLOCKS_INDEX names
    ([] where none were kept)."""
    model_dir = Path(model_dir)
    if (model_dir / BLOCKS_FILE).is_file():
        return [model_dir / BLOCKS_FILE]
    index = model_dir / BLOCKS_INDEX
    if not index.is_file():
        return []
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return [index.parent / name for name in names]


class _Shards:
    """Tensors written as they come: into `stem`.safetensors where `total` bytes fit one file,
    else into `stem`-00001.safetensors, ... of about SHARD_BYTES each and `stem`.safetensors.
    index.json, HF's weight map of a sharded checkpoint. Holds one file's tensors at most."""

    def __init__(self, folder: Path, stem: str, total: int) -> None:
        self.folder, self.stem, self.single = folder, stem, total <= SHARD_BYTES
        self.pending: dict[str, torch.Tensor] = {}
        self.size, self.files, self.total = 0, 0, 0
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.pending[name] = tensor
        self.size += tensor.numel() * tensor.element_size()
        if not self.single and self.size >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        self.files += 1
        name = f"{self.stem}-{self.files:05d}.safetensors"
        self.folder.mkdir(parents=True, exist_ok=True)
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.weight_map |= dict.fromkeys(self.pending, name)
        self.total += self.size
        self.pending, self.size = {}, 0

    def close(self) -> None:
        if self.single:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"{self.stem}.safetensors"
            save_file(self.pending, str(path), metadata={"format": "pt"})
            self.pending = {}
            return
        self._flush()
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        (self.folder / f"{self.stem}.safetensors.index.json").write_text(
            json.dumps(index, indent=2) + "\n"
        )


def is_current_conversion(path: Path) -> bool:
    """True when `path` holds a complete conversion of this version (with BLOCKS_FILE)."""
    if not is_converted_dir(path):
        return False
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("version", 1) >= CONVERSION_VERSION


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: torch.dtype | None = None) -> Path:
    """Convert the llama GGUF at `gguf_path` into an HF model directory at `out_dir`.

    Weights are dequantized and stored as `dtype` (default bfloat16). An existing `out_dir` is
    replaced only if it is empty or a previous conversion. Returns `out_dir`. Raises
    `ModelLoadError` for a missing or invalid file, an unsupported architecture or tensor type.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    dtype = dtype or torch.bfloat16
    reader = _open_gguf(gguf_path)
    arch = str(_field(reader, "general.architecture"))
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} in {gguf_path}: "
            f"{', '.join(_ARCHITECTURES)} are supported"
        )
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        n_head = _int_field(reader, f"{arch}.attention.head_count")
        n_kv = _int_field(reader, f"{arch}.attention.head_count_kv", default=n_head)
        heads = (n_head, n_kv) if arch in _PERMUTED else None
        names = _convert_tensors(reader, gguf_path.name, heads, dtype, tmp)
        with _offline():
            _save_config(gguf_path, tmp, dtype, names, reader, arch)
            _save_tokenizer(gguf_path, tmp, reader, arch)
        marker = {
            "source": str(gguf_path.resolve()),
            "dtype": str(dtype).removeprefix("torch."),
            "version": CONVERSION_VERSION,
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        for path in tmp.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        tmp.chmod(0o755)
        _install(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"not a GGUF file (bad magic bytes): {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def _field(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _int_field(reader: gguf.GGUFReader, key: str, default: int | None = None) -> int:
    value = _field(reader, key)
    if value is None and default is None:
        raise ModelLoadError(f"GGUF file lacks required metadata {key!r}")
    return int(cast(SupportsInt, value if value is not None else default))


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and not is_converted_dir(out_dir) and any(out_dir.iterdir()):
        raise ModelLoadError(f"refusing to overwrite {out_dir}: not a previous GGUF conversion")


def _hf_names(gguf_name: str, experts: int) -> list[str]:
    """The HF names of a GGUF tensor: one, or an expert's each for a stack of `experts`."""
    m = _TENSOR_NAME.fullmatch(gguf_name)
    if m and m["layer"] is None and m["name"] in _GLOBAL_NAMES:
        return [f"{_GLOBAL_NAMES[m['name']]}.{m['kind']}"]
    if m and m["layer"] is not None and m["name"] in _LAYER_NAMES:
        return [f"model.layers.{m['layer']}.{_LAYER_NAMES[m['name']]}.{m['kind']}"]
    if m and m["layer"] is not None and m["name"] in _EXPERT_NAMES:
        prefix, leaf = f"model.layers.{m['layer']}.mlp.experts", _EXPERT_NAMES[m["name"]]
        return [f"{prefix}.{e}.{leaf}.{m['kind']}" for e in range(experts)]
    raise ModelLoadError(f"unsupported tensor {gguf_name!r} in the GGUF")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows (its convert_hf_to_gguf.py, LlamaModel.permute)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _convert_tensors(
    reader: gguf.GGUFReader,
    label: str,
    heads: tuple[int, int] | None,
    dtype: torch.dtype,
    out: Path,
) -> set[str]:
    """Write the dequantized tensors by HF name into `out` (model.safetensors, or shards), and
    the Q4_1 / Q8_0 matrices' stored parts into its BLOCKS_FILE (or shards) where they serve
    the whole model (`_served_whole`), a file's worth at a time; returns the HF names. heads:
    (query, KV) heads whose q/k rows llama.cpp permuted (None: not permuted). A stack of
    experts becomes each expert's matrix, and each expert's stored parts."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    numel = [int(np.prod([int(d) for d in t.shape])) for t in reader.tensors]
    stored = [
        n * (1 + 4 / 32) if t.tensor_type in _STORED_TYPES else 0
        for t, n in zip(reader.tensors, numel, strict=True)
    ]
    weights = _Shards(out, "model", sum(numel) * itemsize)
    blocks = _Shards((out / BLOCKS_FILE).parent, Path(BLOCKS_FILE).stem, int(sum(stored)))
    names: set[str] = set()
    keys: set[str] = set()
    for t in tqdm(reader.tensors, desc=f"converting {label}", unit="tensor"):
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"unsupported GGUF tensor type {t.tensor_type.name} for tensor {t.name!r}"
            ) from e
        w = np.asarray(w, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        stack = w.ndim == 3
        hf = _hf_names(t.name, w.shape[0] if stack else 1)
        parts = _stored_parts(t)
        if heads is not None and (".attn_q." in t.name or ".attn_k." in t.name):
            n = heads[0] if ".attn_q." in t.name else heads[1]  # a permuted q or k
            w = _unpermute(w, n)
            parts = None if parts is None else {k: _unpermute(v, n) for k, v in parts.items()}
        for i, name in enumerate(hf):
            matrix = w[i] if stack else w
            tensor = torch.from_numpy(np.array(matrix, dtype=np.float32)).to(dtype).contiguous()
            weights.add(name, tensor)
            names.add(name)
            for part, values in (parts or {}).items():
                value = values[i] if stack else values
                blocks.add(f"{name}.{part}", torch.from_numpy(np.ascontiguousarray(value)))
                keys.add(f"{name}.{part}")
    weights.close()
    blocks.close()
    if not _served_whole(names, keys):
        shutil.rmtree((out / BLOCKS_FILE).parent)
    return names


_STORED_TYPES = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0)
"""The tensor types whose parts a conversion keeps as stored."""

_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _served_whole(tensors: set[str], blocks: set[str]) -> bool:
    """Whether every matrix the model multiplies by (each layer's projections, each expert's
    too, the head: the embedding where it is tied; not a MoE's router, which llama.cpp keeps
    in F32 and we in the model's dtype) has stored parts, the projections fused into one matmul
    all of one type: else none is kept (the model then runs in its dtype)."""
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    projections = [n for n in tensors if n.endswith("_proj.weight")]
    if not projections or any(f"{n}.q" not in blocks for n in (*projections, head)):
        return False
    for name in projections:
        for group in _FUSED_GROUPS:
            parts = [name.replace(group[0], p) for p in group] if group[0] in name else []
            if len({f"{p}.min" in blocks for p in parts}) > 1:
                return False
    return True


Q4_1_BYTES, Q8_0_BYTES = 20, 34
"""Bytes of a block of 32 values: fp16 scale, fp16 minimum, 16 bytes of nibbles (Q4_1: value
j in byte j's low nibble, value 16 + j in its high one); fp16 scale, 32 int8 (Q8_0)."""


def _stored_parts(t: gguf.ReaderTensor) -> dict[str, np.ndarray] | None:
    """A Q4_1 or Q8_0 matrix's values [rows, cols] (uint8 0..15, or int8), scales and (Q4_1)
    minimums [rows, cols / 32] (fp16), as the file stores them, each with a leading [experts]
    for a stack of experts' matrices; None for other types and for vectors."""
    kind = t.tensor_type
    if kind not in _STORED_TYPES or len(t.shape) < 2:
        return None
    lead = [int(d) for d in reversed(t.shape[1:])]  # [experts,] rows
    size = Q4_1_BYTES if kind == gguf.GGMLQuantizationType.Q4_1 else Q8_0_BYTES
    raw = np.asarray(t.data, dtype=np.uint8).reshape(*lead, -1, size)
    scale = raw[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == gguf.GGMLQuantizationType.Q8_0:
        return {"q": raw[..., 2:].copy().view(np.int8).reshape(*lead, -1), "scale": scale}
    nibbles = raw[..., 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(*lead, -1)
    return {"q": q, "scale": scale, "min": raw[..., 2:4].copy().view(np.float16)[..., 0]}


def _offline() -> contextlib.AbstractContextManager[object]:
    """Keep transformers/huggingface_hub from reaching for the network while reading the GGUF."""
    return mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


def _rewrite_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _save_config(
    gguf_path: Path,
    out: Path,
    dtype: torch.dtype,
    tensors: set[str],
    reader: gguf.GGUFReader,
    arch: str,
) -> None:
    from transformers import AutoConfig, GenerationConfig

    cfg = AutoConfig.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    cfg.architectures = [_ARCHITECTURES[arch]]
    cfg.tie_word_embeddings = "lm_head.weight" not in tensors
    cfg.attention_bias = "model.layers.0.self_attn.q_proj.bias" in tensors
    if arch != "llama":  # qwen3's heads may be wider than hidden / heads
        cfg.head_dim = _int_field(reader, f"{arch}.attention.key_length", cfg.head_dim)
    if arch == "qwen3moe":  # what transformers' GGUF reading leaves out; llama.cpp's rules
        cfg.moe_intermediate_size = _int_field(reader, f"{arch}.expert_feed_forward_length")
        cfg.norm_topk_prob = True  # llama.cpp normalizes the chosen experts' weights
        cfg.decoder_sparse_step, cfg.mlp_only_layers = 1, []
    cfg.dtype = dtype
    cfg.save_pretrained(out)

    def edit(data: dict) -> None:
        data.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
        data["torch_dtype"] = data["dtype"]  # for readers that predate transformers 5

    _rewrite_json(out / "config.json", edit)
    GenerationConfig.from_model_config(cfg).save_pretrained(out)


def _save_tokenizer(gguf_path: Path, out: Path, reader: gguf.GGUFReader, arch: str) -> None:
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    backend = tok.backend_tokenizer
    pre = _field(reader, "tokenizer.ggml.pre")
    if pre in _DIGIT_SPLIT_PRE and isinstance(backend.pre_tokenizer, pre_tokenizers.ByteLevel):
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    context = _field(reader, f"{arch}.context_length")
    if context:
        tok.model_max_length = int(cast(SupportsInt, context))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    if eos is not None and tok.eos_token_id != int(cast(SupportsInt, eos)):
        raise ModelLoadError(f"tokenizer eos id {tok.eos_token_id} != GGUF eos id {eos}")
    tok.save_pretrained(out, save_jinja_files=False)  # chat template inside tokenizer_config
    _rewrite_json(out / "tokenizer_config.json", lambda d: [d.pop(k, None) for k in _LOAD_ARGS])
    specials = json.dumps(tok.special_tokens_map, indent=2, ensure_ascii=False)
    (out / "special_tokens_map.json").write_text(specials + "\n")


def _install(tmp: Path, out_dir: Path) -> None:
    """Move the finished `tmp` to `out_dir`, replacing an empty dir or a previous conversion."""
    _check_replaceable(out_dir)
    trash = None
    if out_dir.exists():
        trash = Path(
            tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent)
        )
        os.replace(out_dir, trash / "old")
    try:
        os.replace(tmp, out_dir)
    except OSError:
        if not is_converted_dir(out_dir):  # otherwise: a concurrent conversion got there first
            raise
    finally:
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
