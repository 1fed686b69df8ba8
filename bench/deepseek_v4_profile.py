"""DeepSeek-V4 on the paged executor: where a prefill and a decode step's time goes per cache
kind (sliding window only, CSA, HCA), and KV bytes per token of V4 against a V3-style (MLA)
model of the same width (issue 25, item 5).

    python bench/deepseek_v4_profile.py [--prompt-len 2048] [--decode 64] [--chunk 512]
                                        [--modes eager,compiled,compiled-pytorch]

The profile runs a small random V4 (built here with transformers: 6 layers of width 512, two
of each kind, window 128, CSA 4:1 with top-64 of 8 indexer heads, HCA 32:1, 8 experts) and
times each layer's attention (`CompressedStep.attend_layer`: rows written, windows pooled,
attention) by its kind; the rest of the step is the projections, experts, hyper-connections
and the head. Each of `--modes` (eager: --enforce-eager; compiled: the layers' graphs, compiled
before the timed request) is profiled in turn in one process. The bytes come from the kind's
own specs (kv/kinds/compressed.py) on the published V4-Flash shape and on a V3-style MLA model
of the same width and depth.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from pypto_serving import LLM, SamplingParams
from pypto_serving.kv.kinds import compressed, mla
from pypto_serving.models.config import load_model_config


def build_v4(out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, PreTrainedTokenizerFast

    csa, hca, swa = (
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "sliding_attention",
    )
    config = DeepseekV4Config(
        vocab_size=4096,
        hidden_size=512,
        moe_intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        head_dim=64,
        q_lora_rank=256,
        qk_rope_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        sliding_window=128,
        o_groups=2,
        o_lora_rank=256,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=64,
        hc_mult=4,
        layer_types=[swa, csa, hca, swa, csa, hca],
        mlp_layer_types=["hash_moe"] + ["moe"] * 5,
        compress_rates={csa: 4, hca: 32},
        max_position_embeddings=16384,
    )
    torch.manual_seed(0)
    DeepseekV4ForCausalLM(config).save_pretrained(out)
    vocab = {f"t{i}": i for i in range(4096)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1").save_pretrained(out)
    return out


def kind_of(compression: compressed.Compression | None) -> str:
    if compression is None:
        return "sliding window"
    return "CSA (window + indexed 4:1)" if compression.indexer else "HCA (window + 32:1)"


def profile(
    model: Path,
    prompt_len: int,
    decode: int,
    dtype: str,
    chunk: int,
    eager: bool,
    native: bool,
    requests: int = 1,
) -> None:
    """Time each step of `requests` requests (each a prefill of `prompt_len` in chunks of
    `chunk`, then `decode` decodes, the decodes of all in one step), and within it each
    layer's attention by its kind; `native`: every query attends on the kind's native kernel
    (the default), else on PyTorch's path."""
    kinds: dict[str, float] = defaultdict(float)
    attend = compressed.CompressedStep.attend_layer

    def timed(self, layer, q, raw, sinks, window, compression):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = attend(self, layer, q, raw, sinks, window, compression)
        kinds[kind_of(compression)] += time.perf_counter() - start
        return out

    compressed.CompressedStep.attend_layer = timed  # type: ignore[method-assign]
    knobs = {"page_size": 32, "max_num_batched_tokens": prompt_len}
    knobs |= {"long_prefill_token_threshold": chunk}
    knobs |= {"enable_prefix_caching": False, "enforce_eager": eager, "native_attention": native}
    llm = LLM(str(model), dtype=dtype, **knobs)
    llm.generate([[5] * 64], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    executor = llm.engine.executor
    execute = executor.execute
    phases: dict[str, list[tuple[float, dict[str, float]]]] = defaultdict(list)

    def step(out):  # type: ignore[no-untyped-def]
        kinds.clear()
        start = time.perf_counter()
        result = execute(out)
        phase = "prefill" if any(s.num_new_tokens > 1 for s in out.scheduled) else "decode"
        phases[phase].append((time.perf_counter() - start, dict(kinds)))
        return result

    executor.execute = step  # type: ignore[method-assign]
    prompt = [[(7 * i + r) % 4000 + 2 for i in range(prompt_len)] for r in range(requests)]
    params = SamplingParams(max_tokens=decode + 1, ignore_eos=True, temperature=0)
    llm.generate(prompt, params, use_tqdm=False)
    for phase, steps in phases.items():
        total = sum(t for t, _ in steps)
        mode = ("eager" if eager else "compiled") + ("" if native else ", PyTorch attention")
        print(
            f"\n{phase} at {prompt_len} tokens ({dtype}, {mode}, {len(steps)} steps): "
            f"{total * 1e3 / len(steps):.1f} ms a step"
        )
        names = sorted({k for _, by_kind in steps for k in by_kind})
        for kind in names:
            s = sum(by_kind.get(kind, 0.0) for _, by_kind in steps)
            print(f"  {kind:28s} {s * 1e3 / len(steps):8.2f} ms  {s / total:6.1%}")
        rest = total - sum(sum(by_kind.values()) for _, by_kind in steps)
        print(f"  {'everything else':28s} {rest * 1e3 / len(steps):8.2f} ms  {rest / total:6.1%}")
    if not eager:
        print(f"  recompilations while timed: {executor.num_recompilations}")
    compressed.CompressedStep.attend_layer = attend  # type: ignore[method-assign]
    llm.close()


def kv_bytes() -> None:
    from transformers import DeepseekV3Config, DeepseekV4Config

    with tempfile.TemporaryDirectory() as tmp:
        v4_dir, v3_dir = Path(tmp, "v4"), Path(tmp, "v3")
        flash = DeepseekV4Config()  # the published V4 shape: 43 layers of width 4096
        flash.save_pretrained(v4_dir)
        layers = flash.num_hidden_layers
        DeepseekV3Config(hidden_size=flash.hidden_size, num_hidden_layers=layers).save_pretrained(
            v3_dir
        )
        for d, arch in ((v4_dir, "DeepseekV4ForCausalLM"), (v3_dir, "DeepseekV3ForCausalLM")):
            raw = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps(raw | {"architectures": [arch]}))
        v4, v3 = load_model_config(v4_dir), load_model_config(v3_dir)
    dtype, latent = torch.bfloat16, mla.kv_spec(v3, layers, 128, torch.bfloat16)
    per_token_v3 = latent.page_bytes / 128
    print(f"\nKV bytes, bf16, {layers} layers of width {flash.hidden_size}:")
    print(f"  V3-style MLA (512 + 64 latent): {per_token_v3:,.0f} B a token")
    for page in (128, 16):
        entries = compressed.kv_spec(v4, range(layers), page, dtype)
        rows, keep = compressed.row_spec(v4, range(layers), page, dtype)
        found = compressed.input_spec(v4, range(layers), page, dtype)
        assert found is not None, "V4-Flash has CSA layers"
        inputs, input_keep = found

        def held(keep: int, page_bytes: int, page: int = page) -> int:
            return (-(-keep // page) + 1) * page_bytes  # the window and the page written

        per_token_v4 = entries.page_bytes / page
        rows_now = held(keep, rows.page_bytes) + held(input_keep, inputs.page_bytes)
        # before: CSA's inputs were kept in the rows, as long as the longest span
        rows_before = held(max(keep, input_keep), rows.page_bytes + inputs.page_bytes)
        print(f"  pages of {page}:")
        print(f"    V4 entries (CSA 4:1 + indexer keys, HCA 128:1): {per_token_v4:,.0f} B a token")
        print(
            f"    V4 rows a sequence: raw rows and HCA inputs (kept {keep} tokens) "
            f"{held(keep, rows.page_bytes):,} B + CSA inputs (kept {input_keep}) "
            f"{held(input_keep, inputs.page_bytes):,} B = {rows_now:,} B (all kept "
            f"{max(keep, input_keep)} tokens: {rows_before:,} B)"
        )
        for n in (4096, 65536, 1 << 20):
            now = (per_token_v4 * n + rows_now) / (per_token_v3 * n)
            before = (per_token_v4 * n + rows_before) / (per_token_v3 * n)
            print(
                f"    at {n:>9,} tokens V4 keeps {now:.3f}x the MLA model's bytes "
                f"({before:.3f}x with CSA's inputs kept as long as the rows)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1, help="requests decoding together")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens a step")
    parser.add_argument(
        "--modes",
        default="eager,compiled",
        help="eager, compiled, compiled-pytorch (compiled, every query's attention on PyTorch's "
        "path instead of the native kernel: --no-native-attention), in the order given",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not modes or set(modes) - {"eager", "compiled", "compiled-pytorch"}:
        parser.error(f"--modes takes eager, compiled, compiled-pytorch, got {args.modes!r}")
    torch.set_num_threads(torch.get_num_threads())
    kv_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_v4(Path(tmp))
        for mode in modes:
            eager, native = mode == "eager", mode != "compiled-pytorch"
            profile(
                model,
                args.prompt_len,
                args.decode,
                args.dtype,
                args.chunk,
                eager,
                native,
                args.requests,
            )


if __name__ == "__main__":
    main()
