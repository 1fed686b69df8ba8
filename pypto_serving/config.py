"""Engine configuration as dataclasses; each field carries its meaning, checks run in one place.

The CLI derives its flags from these fields (see cli.py), so a knob is declared once.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pypto_serving.errors import PyptoError

EXECUTORS = ("paged", "reference")
LOAD_BALANCE = ("internal", "least_pending_tokens", "round_robin")
"""Router policies; "internal" (the parallel-strategy note's spelling) is the built-in
router's default policy, least_pending_tokens."""
BACKENDS = ("gloo", "nccl")
PLACEMENTS = ("linear", "round_robin")
ALL2ALL_BACKENDS = ("pypto_default", "all_to_all", "allgather_reducescatter")
"""Expert exchanges; "pypto_default" is the project's default one, all_to_all."""
DATA_PARALLEL_BACKENDS = ("mp", "local")
"""How replicas run: "mp" processes on this machine or over nnodes machines, "local" processes
on this machine only (nnodes 1)."""
QUANTIZATIONS = ("int8", "int4", "w8a8", "int4-w8a8", "gguf")
"""The forms a model's linear layers can take (besides its dtype)."""
QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATIONS)
CALIBRATED_QUANTIZATIONS = ("w8a8", "int4-w8a8")
"""Those with int8 activations, whose smoothing factors come from running the whole model."""
KV_CACHE_DTYPES = ("auto", "int8")
SECTION_NAMES = ("scheduler", "cache", "parallel")
"""EngineConfig's sub-configs (and the JSON config file's sections of the same names)."""


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks plus decodes)."""
    long_prefill_token_threshold: int = 512
    """Most prompt tokens one request may take in a step (0 = no cap), so decodes keep flowing."""

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            minimum = 0 if f.name == "long_prefill_token_threshold" else 1
            if not isinstance(value, int) or value < minimum:
                raise PyptoError(f"{f.name} must be an integer >= {minimum}, got {value!r}")


@dataclass(slots=True)
class CacheConfig:
    page_size: int = 64
    """Tokens per KV page."""
    num_kv_pages: int | None = None
    """Device KV pages to allocate; None sizes the pool from kv_device_bytes."""
    kv_device_bytes: int = 2 << 30
    """Byte budget of the device KV pool when num_kv_pages is not given (e.g. 2GiB)."""
    gpu_memory_utilization: float | None = None
    """vLLM's flag: the fraction of the device's memory available at start (the CPU's
    MemAvailable, or the GPU's free memory) that the weights and the KV pool may take
    together; the pool gets that less the weights, shared by the ranks on this machine. It
    replaces kv_device_bytes; num_kv_pages, if given, still wins."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full pages whose token prefix was seen before."""
    kv_cpu_bytes: int = 4 << 30
    """Byte budget of the CPU tier: cached pages pushed out of the device, and the KV of
    requests preempted by swap (0: no CPU tier); under TP/PP the engine's, each rank holding
    its share."""
    kv_ssd_dir: str | None = None
    """Directory of the SSD tier (None: no SSD tier); pages there survive restarts (under
    TP/PP each rank keeps its share in `<kv_ssd_dir>/rank<r>`)."""
    kv_ssd_bytes: int = 16 << 30
    """Byte budget of the SSD tier when kv_ssd_dir is set; under TP/PP the engine's, each
    rank holding its share."""
    kv_remote: str | None = None
    """A KV pool shared by every server and replica pointed at it: the master of a Mooncake
    Store, as mooncake://HOST:PORT (None: no remote tier). Pages computed here are written to
    it and prefixes found there are loaded from it (`kv/remote_tier.py`)."""
    kv_remote_bytes: int = 1 << 30
    """Memory this process lends to the shared pool when kv_remote is set (each member lends
    its share; the pool is their sum); at least 16MiB, Mooncake's least."""
    kv_events_endpoint: str | None = None
    """A ZeroMQ endpoint to publish KV events on (pages stored into and removed from each
    tier's prefix index, in vLLM's format), e.g. tcp://127.0.0.1:5557; data-parallel replica r
    takes port + r. One other machines can reach needs kv_events_curve_key. None: no events."""
    kv_events_topic: str = ""
    """The topic of every KV event message."""
    kv_events_replay_endpoint: str | None = None
    """A ZeroMQ endpoint where subscribers ask for the batches they missed (vLLM's replay
    socket: a ROUTER; send the first sequence number wanted, 8 bytes big-endian), e.g.
    tcp://127.0.0.1:5558; data-parallel replica r takes port + r. None: no replay."""
    kv_events_curve_key: str | None = None
    """A file with the KV event sockets' ZeroMQ CURVE key pair (a `.key_secret` file, as
    `zmq.auth.create_certificates` writes it): the sockets then encrypt, and admit only the
    subscribers whose public keys are in kv_events_curve_clients. Needed to bind an address
    other machines can reach."""
    kv_events_curve_clients: str | None = None
    """A folder of the public keys (`.key` files) of the subscribers the KV event sockets
    admit, read at start-up; set with kv_events_curve_key."""
    kv_cache_dtype: str = "auto"
    """How keys and values are stored: auto (the model's dtype) or int8 (each token's row of a
    head quantized with its own scale: about half of bf16's bytes, so decode attention reads
    half and twice the tokens fit; needs the native CPU attention kernels)."""

    def validate(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise PyptoError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise PyptoError(f"page_size must be an integer >= 1, got {self.page_size!r}")
        if self.num_kv_pages is not None and (
            not isinstance(self.num_kv_pages, int) or self.num_kv_pages < 1
        ):
            raise PyptoError(f"num_kv_pages must be an integer >= 1, got {self.num_kv_pages!r}")
        f = self.gpu_memory_utilization
        if f is not None and (not isinstance(f, int | float) or not 0 < f <= 1):
            raise PyptoError(
                f"gpu_memory_utilization must be a fraction in (0, 1], got {f!r}",
                "gpu_memory_utilization",
            )
        for name in ("kv_device_bytes", "kv_cpu_bytes", "kv_ssd_bytes", "kv_remote_bytes"):
            value = parse_bytes(getattr(self, name), name)
            minimum = 1 if name == "kv_device_bytes" else 0
            if value < minimum:
                raise PyptoError(f"{name} must be >= {minimum}, got {value!r}")
            setattr(self, name, value)
        if self.kv_ssd_dir is not None and not str(self.kv_ssd_dir).strip():
            raise PyptoError("kv_ssd_dir must not be empty")
        self._validate_events()
        if self.kv_remote is not None:
            remote_address(self.kv_remote)
            if self.kv_remote_bytes < MOONCAKE_MIN_SEGMENT_BYTES:
                raise PyptoError(
                    f"kv_remote_bytes (--kv-remote-bytes) must be at least "
                    f"{MOONCAKE_MIN_SEGMENT_BYTES >> 20}MiB, the least a Mooncake Store member "
                    f"may lend the pool; got {self.kv_remote_bytes}",
                    "kv_remote_bytes",
                )

    def _validate_events(self) -> None:
        """KV events tell which prompts are cached (their tokens, unless salted): a socket
        other machines can reach must authenticate its subscribers."""
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise PyptoError("kv_events_replay_endpoint needs kv_events_endpoint (the events)")
        if (self.kv_events_curve_key is None) != (self.kv_events_curve_clients is None):
            raise PyptoError(
                "kv_events_curve_key and kv_events_curve_clients go together (the server's key "
                "pair and the subscribers it admits)",
                "kv_events_curve_key",
            )
        if self.kv_events_curve_key is not None:
            return
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not local_endpoint(endpoint):
                raise PyptoError(
                    f"{name} {endpoint} can be reached from other machines, and KV events tell "
                    f"the prompts cached here: bind loopback (e.g. tcp://127.0.0.1:5557) or set "
                    f"kv_events_curve_key and kv_events_curve_clients (ZeroMQ CURVE: encrypted, "
                    f"subscribers authenticated; see docs/serving.md, KV events)",
                    name,
                )


def local_endpoint(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable from this machine only: ipc:// or inproc://, or
    tcp:// on a loopback address (127.0.0.0/8, ::1, localhost). An interface name or `*` is
    not."""
    scheme, _, rest = str(endpoint).partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    if scheme != "tcp" or not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


REMOTE_SCHEME = "mooncake"
MOONCAKE_MIN_SEGMENT_BYTES = 16 << 20
"""The least memory a Mooncake Store client may lend the pool: its `setup` refuses less
("Total size must be at least 16777216", then the join fails with -600; mooncake 0.3.13)."""


def remote_address(url: str, field_name: str = "kv_remote") -> tuple[str, int]:
    """(host, port) of a Mooncake master's URL, mooncake://HOST:PORT (the `field_name`
    option's value); PyptoError otherwise."""
    parts = urlsplit(str(url))
    try:
        port = parts.port
    except ValueError:
        port = None
    if (
        parts.scheme != REMOTE_SCHEME
        or not parts.hostname
        or port is None
        or parts.path not in ("", "/")
    ):
        raise PyptoError(
            f"{field_name} must look like mooncake://HOST:PORT (a Mooncake master's RPC "
            f"address), got {url!r}",
            field_name,
        )
    return parts.hostname, port


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS |= {u + "i": 1 << (10 * i) for i, u in enumerate("kmgt", start=1)}


def parse_bytes(value: object, name: str = "size") -> int:
    """A byte count from an int or a string such as '512MiB', '4G' or '1.5GiB'."""
    if isinstance(value, bool):
        raise PyptoError(f"{name} must be a byte count, got {value!r}")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", str(value), re.IGNORECASE)
    if not isinstance(value, str) or match is None:
        raise PyptoError(f"{name} must be a byte count such as 4294967296 or 4GiB, got {value!r}")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


@dataclass(slots=True)
class ParallelConfig:
    data_parallel_size: int = 1
    """Engine replicas (DP), each a process with its own scheduler, KV store and executor."""
    data_parallel_load_balance: str = "least_pending_tokens"
    """How node 0's router spreads requests over DP replicas: least_pending_tokens (queued
    plus running remaining tokens, less the prompt tokens a replica likely holds in its prefix
    cache), round_robin, or internal (the built-in router's default policy,
    least_pending_tokens)."""
    tensor_parallel_size: int = 1
    """Processes (ranks) one engine's model is split across: attention heads, KV heads, MLP
    columns and the vocabulary; rank 0 schedules and broadcasts each step."""
    pipeline_parallel_size: int = 1
    """Pipeline stages one engine's layers are split into, a rank each; activations pass
    from stage to stage point-to-point, rank 0 (the first stage) schedules."""
    enable_expert_parallel: bool = False
    """Mixture-of-experts models: place whole experts across the tensor-parallel ranks
    (their outputs summed with an all-reduce) or, with data_parallel_size > 1, across every
    replica's ranks (DP attention + EP: each replica's tokens sent to the ranks holding their
    experts; with TP in each replica, each TP rank exchanges with the ranks of its TP index in
    the others, and the replica all-reduces), instead of every rank holding every expert."""
    expert_placement_strategy: str = "linear"
    """Which experts a rank holds with expert parallelism: linear (contiguous blocks) or
    round_robin (every N-th)."""
    all2all_backend: str = "pypto_default"
    """DP attention + EP: how a replica's tokens reach the experts of the others and come
    back. pypto_default: the project's default exchange, all_to_all; all_to_all: each
    token row goes only to the replicas holding its chosen experts and their weighted
    outputs come back, by all-to-all; allgather_reducescatter: every replica gathers all
    replicas' tokens, runs its experts on them and a reduce-scatter returns each replica the
    sums of its own tokens (more traffic, simpler collectives)."""
    data_parallel_backend: str = "mp"
    """How data-parallel replicas run: mp (a process each, on this machine or spread over
    nnodes machines) or local (a process each, all on this machine: nnodes must be 1)."""
    distributed_backend: str | None = None
    """torch.distributed backend of the tensor-parallel ranks: gloo or nccl (None: nccl on
    CUDA, gloo on the CPU)."""
    devices: str | None = None
    """Comma-separated devices, one per process on this machine (DP replicas x TP ranks,
    e.g. cuda:0,cuda:1); None: automatic (a GPU each where there are enough, else the CPU
    with its cores split between the processes)."""
    nnodes: int = 1
    """Machines the engine spans; every one runs `pypto serve` with the same options and its
    own node_rank. With data_parallel_size 1 its tensor/pipeline ranks are spread over them;
    with data_parallel_size > 1 its replicas are (data_parallel_size / nnodes on each, every
    replica's ranks on one node), node 0's router sending requests to all of them."""
    node_rank: int = 0
    """This machine's index among nnodes: 0 runs the engine (rank 0, or the replicas' router)
    and serves; the others only host their ranks or replicas."""
    headless: bool = False
    """This node serves no HTTP, only hosts its ranks (vLLM's --headless): what every node
    but 0 does; saying so is optional there, and an error on node 0 (it runs the engine)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where the ranks rendezvous (torch.distributed's MASTER_ADDR), or
    where the other nodes' replicas connect."""
    master_port: int | None = None
    """Rendezvous port on node 0 when nnodes > 1 (MASTER_PORT; with data parallelism the
    replicas' channels, and master_port + 1 the rendezvous of DP attention + EP); ranks on
    one machine meet through a file instead, with no listening socket."""
    startup_timeout_s: float = 600.0
    """How long a data-parallel replica or a tensor/pipeline rank may take to start (load
    the model, compile, warm up) before start-up fails naming it and stops the others."""

    @property
    def ranks_per_engine(self) -> int:
        """torch.distributed ranks of one engine (all machines): TP x PP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        """Processes on this machine: DP replicas x the ranks each hosts here."""
        return self.data_parallel_size * self.ranks_per_engine // max(self.nnodes, 1)

    def device_list(self) -> list[str] | None:
        """The devices given, one per replica (None when automatic)."""
        if self.devices is None:
            return None
        names = self.devices if isinstance(self.devices, list) else str(self.devices).split(",")
        return [str(n).strip() for n in names]

    def validate(self) -> None:
        for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise PyptoError(f"{name} must be an integer >= 1, got {n!r}")
        for name, low in (("nnodes", 1), ("node_rank", 0)):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < low:
                raise PyptoError(f"{name} must be an integer >= {low}, got {n!r}")
        if self.node_rank >= self.nnodes:
            raise PyptoError(
                f"node_rank must be below nnodes ({self.nnodes}), got {self.node_rank}"
            )
        if self.headless and self.node_rank == 0:
            raise PyptoError(
                "headless is for nodes other than 0 (node 0 runs the engine and serves); "
                "give this node its node_rank"
            )
        if self.nnodes > 1:
            if self.data_parallel_size > 1 and self.data_parallel_size % self.nnodes:
                raise PyptoError(
                    f"data_parallel_size ({self.data_parallel_size}) must be a multiple of "
                    f"nnodes {self.nnodes} (as many replicas on every node; each replica's "
                    "ranks on one node)"
                )
            if self.data_parallel_size == 1 and self.ranks_per_engine % self.nnodes:
                raise PyptoError(
                    f"tensor_parallel_size x pipeline_parallel_size ({self.ranks_per_engine}) "
                    f"must be a multiple of nnodes {self.nnodes} (as many ranks on every node)"
                )
            if self.master_port is None:
                raise PyptoError("nnodes > 1 needs master_port (the same on every node)")
            if self.expert_parallel_over_dp and self.master_port == 65535:
                raise PyptoError(
                    "DP attention + EP on several nodes also listens on master_port + 1: "
                    "give a master_port below 65535"
                )
        t = self.startup_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < float("inf"):
            raise PyptoError(f"startup_timeout_s must be a number > 0, got {t!r}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise PyptoError(f"master_port must be in [1, 65535], got {self.master_port!r}")
        if self.expert_placement_strategy not in PLACEMENTS:
            raise PyptoError(
                f"expert_placement_strategy must be one of {', '.join(PLACEMENTS)}, "
                f"got {self.expert_placement_strategy!r}"
            )
        self._validate_expert_parallel()
        if self.distributed_backend not in (None, *BACKENDS):
            raise PyptoError(
                f"distributed_backend must be one of {', '.join(BACKENDS)}, "
                f"got {self.distributed_backend!r}"
            )
        if self.data_parallel_load_balance not in LOAD_BALANCE:
            raise PyptoError(
                f"data_parallel_load_balance must be one of {', '.join(LOAD_BALANCE)}, "
                f"got {self.data_parallel_load_balance!r}"
            )
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise PyptoError(
                "data_parallel_backend must be 'mp' (each replica a process, on this machine "
                "or over nnodes machines) or 'local' (each replica a process on this machine), "
                f"got {self.data_parallel_backend!r}"
            )
        if self.data_parallel_backend == "local" and self.nnodes > 1:
            raise PyptoError(
                f"data_parallel_backend 'local' keeps every replica on this machine, but nnodes "
                f"is {self.nnodes}: use 'mp' to spread replicas over machines"
            )
        devices = self.device_list()
        if devices is not None:
            if any(not d for d in devices):
                raise PyptoError(f"devices must name one device per replica, got {self.devices!r}")
            # a DP attention + EP replica's own config names its ranks' devices only
            own = self.expert_parallel_over_dp and len(devices) == self.ranks_per_engine
            if len(devices) != self.world_size and not own:
                raise PyptoError(
                    f"devices names {len(devices)} device(s) for {self.world_size} process(es) "
                    f"on this machine (data_parallel_size {self.data_parallel_size} x "
                    f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                    f"{self.pipeline_parallel_size} / nnodes {self.nnodes}); give one per process"
                )

    def _validate_expert_parallel(self) -> None:
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise PyptoError(
                f"all2all_backend must be one of {', '.join(ALL2ALL_BACKENDS)}, "
                f"got {self.all2all_backend!r}"
            )
        if not self.enable_expert_parallel:
            return
        if self.tensor_parallel_size == 1 and self.data_parallel_size == 1:
            raise PyptoError(
                "enable_expert_parallel places experts across the tensor-parallel ranks or the "
                "data-parallel replicas: set tensor_parallel_size > 1 (or data_parallel_size > 1)"
            )
        if self.data_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise PyptoError(
                "enable_expert_parallel with data_parallel_size > 1 (DP attention + EP) needs "
                "pipeline_parallel_size 1: its expert group is every replica's TP ranks (an "
                "expert group over pipeline stages is not supported)"
            )
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1 and self.nnodes > 1:
            raise PyptoError(
                "enable_expert_parallel with data_parallel_size > 1 and tensor_parallel_size > "
                f"1 spans one machine for now (nnodes is {self.nnodes}): its expert group of "
                "replicas x TP ranks meets through a file"
            )

    @property
    def all2all_exchange(self) -> str:
        """The exchange `all2all_backend` names (pypto_default: all_to_all)."""
        return "all_to_all" if self.all2all_backend == "pypto_default" else self.all2all_backend

    @property
    def load_balance_policy(self) -> str:
        """The router policy `data_parallel_load_balance` names (internal: the default)."""
        policy = self.data_parallel_load_balance
        return "least_pending_tokens" if policy == "internal" else policy

    @property
    def expert_parallel_over_dp(self) -> bool:
        """DP attention + EP: the replicas' MoE layers form one expert-parallel group."""
        return self.enable_expert_parallel and self.data_parallel_size > 1


SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp", "deepseek_mtp")
SPECULATIVE_NOT_YET = {
    "eagle": "EAGLE heads",
    "eagle3": "EAGLE-3 heads",
    "medusa": "Medusa heads",
    "mlp_speculator": "MLP speculators",
    "suffix": "suffix decoding",
}
"""vLLM's other methods: refused, each named."""
SPECULATIVE_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "quantization",
}


@dataclass(frozen=True, slots=True)
class SpeculativeSpec:
    """An engine's speculative decoding, as --speculative-config gives it."""

    method: str
    num_speculative_tokens: int
    """The most draft tokens a request verifies in one step (k)."""
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    """ngram: the n-grams looked up, the longest first, down to the shortest."""
    model: str | None = None
    """draft_model: the draft model (a Hugging Face directory or a GGUF file, as --model
    takes it), sharing the target's tokenizer."""
    quantization: str = "auto"
    """draft_model: its quantization (--quantization's choices; auto: a GGUF file's own
    matrices, else none), whatever the target's."""


def parse_speculative_config(raw: str | dict[str, Any] | None) -> SpeculativeSpec | None:
    """vLLM's --speculative-config (a JSON object, or the dict) as a spec; None: off.
    A method other than ngram and draft_model, a missing k, a bad lookup range or a draft
    model without its path is a PyptoError naming it."""
    if raw is None:
        return None
    param = "speculative_config"
    try:
        spec = json.loads(raw) if isinstance(raw, str) else raw
        if not isinstance(spec, dict):
            raise ValueError(type(spec).__name__)
    except ValueError as e:
        raise PyptoError(f"speculative_config is not a JSON object: {e}", param) from None
    unknown = sorted(set(spec) - SPECULATIVE_KEYS)
    if unknown:
        raise PyptoError(
            f"speculative_config: {', '.join(unknown)} not understood here (keys: "
            f"{', '.join(sorted(SPECULATIVE_KEYS))})",
            param,
        )
    method = spec.get("method") or ("draft_model" if spec.get("model") else None)
    if method == "[ngram]" or (method is None and spec.get("model") == "[ngram]"):
        method = "ngram"  # vLLM's older spelling
    if method in SPECULATIVE_NOT_YET:
        raise PyptoError(
            f"speculative_config: method {method!r} ({SPECULATIVE_NOT_YET[method]}) is not "
            'available yet; use {"method": "ngram", ...} or {"model": DIR, ...}',
            param,
        )
    if method == "ngram" and "quantization" in spec:
        raise PyptoError("speculative_config: quantization belongs to a draft model", param)
    if method in ("mtp", "deepseek_mtp"):
        extra = sorted(set(spec) - {"method", "num_speculative_tokens"})
        if extra:
            raise PyptoError(
                f"speculative_config: {', '.join(extra)} not understood with method {method} "
                "(the checkpoint's own multi-token prediction layer drafts)",
                param,
            )
    if method not in SPECULATIVE_METHODS:
        raise PyptoError(
            "speculative_config: method must be one of "
            f"{', '.join(SPECULATIVE_METHODS)}, got {method!r}",
            param,
        )
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
        raise PyptoError(
            f"speculative_config: num_speculative_tokens must be an integer in [1, 32], got {k!r}",
            param,
        )
    if method in ("mtp", "deepseek_mtp"):
        return SpeculativeSpec("mtp", k)
    if method == "draft_model":
        model = spec.get("model")
        if not isinstance(model, str) or not model:
            raise PyptoError(
                "speculative_config: a draft model needs its path: "
                '{"model": DIR or FILE.gguf, "num_speculative_tokens": k}',
                param,
            )
        quantization = spec.get("quantization") or "auto"
        if quantization not in QUANTIZATION_CHOICES:
            raise PyptoError(
                f"speculative_config: quantization must be one of {QUANTIZATION_CHOICES}, "
                f"got {quantization!r}",
                param,
            )
        lookup = sorted({"prompt_lookup_min", "prompt_lookup_max"} & set(spec))
        if lookup:
            raise PyptoError(
                f"speculative_config: {', '.join(lookup)} belong to the ngram method, not "
                "to a draft model",
                param,
            )
        return SpeculativeSpec(method, k, model=model, quantization=quantization)
    given = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if given == (None, None):
        given = (5, 5)  # as vLLM: neither given is 5; one given is both
    lo = given[1] if given[0] is None else given[0]
    hi = lo if given[1] is None else given[1]
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64) or (
        isinstance(lo, bool) or isinstance(hi, bool)
    ):
        raise PyptoError(
            "speculative_config: prompt_lookup_min and prompt_lookup_max must be integers "
            f"with 1 <= min <= max <= 64, got {lo!r} and {hi!r}",
            param,
        )
    return SpeculativeSpec(method, k, lo, hi)


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"
    """A Hugging Face model directory, a .gguf file, or 'default' (SmolLM2-135M-Instruct)."""
    dtype: str = "auto"
    """auto, float32, bfloat16 or float16 (vLLM's half and float too; auto: bfloat16 where
    the hardware has it)."""
    device: str = "auto"
    """auto (CUDA if present, else CPU), cpu, cuda, cuda:N."""
    executor: str = "paged"
    """paged (batched, paged KV: the serving path) or reference (the plain-PyTorch oracle)."""
    enforce_eager: bool = False
    """Run the paged executor without torch.compile (no start-up compile; slower steps)."""
    background_compile: bool = False
    """Compile in a background thread after loading, serving meanwhile (eagerly wherever a
    graph is not ready yet): the engine is ready, and answers, before g++ is done. Off
    offline (a run then starts at full speed); on for `pypto serve`. Not under tensor or
    pipeline parallelism."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); None uses the model's own limit. Longer than the
    model's context length (max_position_embeddings) is refused, as vLLM refuses it; the
    KV pages' capacity may lower it (said in the start-up log)."""
    num_threads: int | None = None
    """CPU threads for PyTorch; None uses every core this process may run on."""
    native_attention: bool = True
    """Paged attention on the native C++ kernels on the CPU (off: PyTorch's attention)."""
    native_decode: bool = True
    """Steps of up to 8 decodes as one native C++ call where the model allows (off: graphs)."""
    pack_linear: bool = True
    """Repack bf16 linear weights for oneDNN where the CPU packs bf16, else in panels for the
    native GEMM (off: plain weights)."""
    batch_invariant: bool = False
    """A row's result does not depend on the rows that share its step, how its prompt was
    chunked, or whether its prefix came from the cache: greedy outputs are the same bits
    alone or in any batch. Every matmul runs on one kernel whatever its rows: a bf16 or
    float32 model's on the native GEMM's panels (each output one chain of FMAs), an int8,
    int4 or int4-w8a8 model's on the native decode step's records (int4's Q4, int8's and
    every head's Q8, int8 activations per 32 inputs, exact integer sums), w8a8's on its
    exact integer GEMM; decodes on the compiled graphs, not the native decode step, whose
    numerics differ (CPU only). Costs speed: see docs/performance.md."""
    quantization: str | None = "auto"
    """Quantization of the linear layers (CPU, bfloat16). gguf: a GGUF file's own Q4_1 and
    Q8_0 matrices as stored, for the native decode step (as llama.cpp runs them; no second
    quantization). Weight-only: int8 (a scale per output row) or int4 (scale and minimum per
    32 inputs, as llama.cpp's Q4_1): fewer bytes per decode step. w8a8: int8 weights and int8
    activations (per token, smoothed), for faster batched steps. int4-w8a8: int4 for matmuls
    of up to 8 rows (decoding a few sequences), w8a8 above (prefill, batched decodes). none
    keeps the weights in dtype. auto: gguf for a GGUF file whose matrices are all Q4_1 or
    Q8_0 where the native decode step runs (the start-up log says), else none. Each but none
    costs some accuracy against the unquantized model."""
    max_logprobs: int = 20
    """vLLM's --max-logprobs: the most logprobs (top_logprobs) and prompt_logprobs a request
    may ask for; -1: the whole vocabulary, which a request asks for with -1 (the server's
    --max-response-logprobs still bounds a response)."""
    seed: int | None = None
    """vLLM's --seed: the random state of sampling for requests that bring no seed of their
    own, set when the engine starts (the same server, requests and order: the same tokens).
    None: a state from the operating system."""
    step_timeout_s: float = 60.0
    """A step (or a data-parallel replica's step) making no progress (no layer done) for
    longer is taken for a hang: the watchdog fails the requests it held and reports the
    engine (or replica) dead. A prompt one layer of which would take longer is refused."""
    runner: str = "auto"
    """vLLM's --runner: auto (a model whose directory declares a sentence-transformers pooling
    config embeds, by its rule), generate (no embeddings), or pooling (any model embeds, its
    last token's hidden state unless its config says otherwise). Generation stays served."""
    chat_template: str | None = None
    """vLLM's --chat-template: a file holding a Jinja chat template, or the template itself;
    it replaces the tokenizer's own for chat, /tokenize, LLM.chat and `pypto chat`."""
    generation_config: str = "auto"
    """vLLM's --generation-config: auto (the model's generation_config.json), vllm (none) or
    a directory holding a generation_config.json. Its temperature, top_p, top_k, min_p,
    repetition_penalty and max_new_tokens are the defaults of requests that leave them out
    (max_new_tokens: of max_tokens), as vLLM applies them."""
    speculative_config: str | dict[str, Any] | None = None
    """vLLM's --speculative-config, as JSON: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b}: a decoding request's next tokens guessed
    from the longest of its recent a..b-grams that occurred before it (prompt lookup); or
    {"model": DIR, "num_speculative_tokens": k}: guessed by a smaller model sharing the
    tokenizer, greedily. Up to k of them verified in one step with its last token
    (speculative.py; fewer where its guesses have been missing). The same greedy tokens, the
    same sampled distribution."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def speculation(self) -> SpeculativeSpec | None:
        """The speculative decoding asked for (None: off); a PyptoError where the JSON is
        not one this server runs."""
        return parse_speculative_config(self.speculative_config)

    def validate(self) -> None:
        if self.executor not in EXECUTORS:
            raise PyptoError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.runner not in RUNNERS:
            raise PyptoError(
                f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}", "runner"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise PyptoError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            raise PyptoError(
                f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}"
            )
        if self.batch_invariant and self.executor != "paged":
            raise PyptoError("--batch-invariant needs the paged executor", "batch_invariant")
        spec = self.speculation()
        if spec is not None and self.executor != "paged":
            raise PyptoError(
                "speculative decoding needs the paged executor (the reference executor is "
                "the plain oracle)",
                "speculative_config",
            )
        if not isinstance(self.step_timeout_s, int | float) or not self.step_timeout_s > 0:
            raise PyptoError(f"step_timeout_s must be > 0, got {self.step_timeout_s!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise PyptoError(f"num_threads must be >= 1, got {self.num_threads!r}")
        self.scheduler.validate()
        self.cache.validate()
        self.parallel.validate()
        p = self.parallel
        if p.world_size > 1 and self.executor == "reference":
            raise PyptoError("data and tensor parallelism need the paged executor")
        if self.cache.kv_remote is not None:
            if self.executor != "paged":
                raise PyptoError("kv_remote needs the paged executor (its KV store)", "kv_remote")
            if p.ranks_per_engine > 1:
                raise PyptoError(
                    "kv_remote runs with tensor_parallel_size and pipeline_parallel_size 1 "
                    "(each data-parallel replica joins the pool); leave it out under TP/PP",
                    "kv_remote",
                )
        if p.ranks_per_engine > 1 and self.quantization in CALIBRATED_QUANTIZATIONS:
            raise PyptoError(
                f"quantization {self.quantization} is not available with tensor or pipeline "
                "parallelism yet (its calibration runs the whole model on one rank)"
            )


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """How a server takes part in disaggregated serving (`ServerConfig.transfer`)."""

    role: str
    """prefill, decode or both."""
    host: str | None
    """The address its Transfer Engine offers KV at (None: chosen at start-up)."""
    protocol: str
    """tcp or rdma."""
    store: str | None = None
    """mooncake://HOST:PORT: the handoffs go through that Mooncake Store (None: peer to
    peer over the Transfer Engine)."""


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)."""
    port: int = 8000
    served_model_name: list[str] | None = None
    """The model names clients may use, one or several (vLLM's `--served-model-name a b`; the
    first is the one metrics carry and a request without `model` is answered as); a string
    in a config file is one name. None uses the model directory's (or GGUF file's) name."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` on every route but /health. `pypto serve` also
    reads it from PYPTO_API_KEY or VLLM_API_KEY (vLLM's), out of sight of `ps`."""
    max_request_bytes: int = 4 << 20
    """Largest request body accepted; larger ones get 413."""
    max_header_bytes: int = 16 << 10
    """Largest request headers accepted (names and values together); larger ones get 431."""
    log_interval_s: float = 5.0
    """Seconds between throughput log lines while busy."""
    max_queued_requests: int | None = None
    """Sequences that may wait beyond the max_num_seqs running ones (per replica); a request
    over the limit gets 503 with Retry-After at once (None: no limit)."""
    max_queued_tokens: int | None = None
    """Prompt tokens that may wait for their first output token (queued or in prefill); a
    request that would pass the limit gets 503 with Retry-After, unless none are waiting
    (None: no limit)."""
    shutdown_timeout: float = 30.0
    """On SIGTERM, seconds the requests in flight may take to finish (new ones get 503)
    before they end with an error and the server exits."""
    header_timeout_s: float = 20.0
    """Seconds a client may take to send a request's headers (from connecting, or from the
    previous response); a slower one is disconnected (a slowloris client holds nothing)."""
    body_timeout_s: float = 60.0
    """Seconds a client may take to send a request's body after its headers; a slower one
    gets 408 and is disconnected."""
    max_connections: int = 512
    """Most client connections open at once. One more closes the connection that has waited
    longest for a request's headers (of the client holding the most); where none waits, a
    request on it gets 503 with Retry-After (/health is answered) and it is closed."""
    max_connections_per_client: int = 256
    """Most connections open at once from one client (IP address). One more closes that
    client's connection that has waited longest for a request's headers; where none waits, a
    request on it gets 503 with Retry-After (/health is answered) and it is closed."""
    max_response_logprobs: int = 1_000_000
    """Most logprobs one response may hold (each token's and each top alternative, over every
    choice, echoed prompt, prompt_logprobs and max_tokens); a request that could pass it is
    a 400 before it runs (tens of MB of JSON at the limit)."""
    allowed_origins: str | None = None
    """Web pages that may call the API from a browser (CORS): comma-separated origins such
    as https://app.example.com, or * for any. None: no CORS headers (browsers refuse)."""
    access_log: bool = False
    """Log one line per HTTP request (method, path, status), as uvicorn writes them."""
    web_ui: bool = True
    """Serve the chat and dashboard page at / (--no-web-ui: no page; / is a 404)."""
    uvicorn_log_level: str = "warning"
    """uvicorn's own log level (vLLM's flag): critical, error, warning, info, debug or trace
    (the access log, --access-log, stays at info)."""
    disable_log_requests: bool = False
    """vLLM's flag, accepted: this server never logs a request's prompt or parameters, so
    there is nothing more to turn off (the access log is --access-log's, off by default)."""
    trust_remote_code: bool = False
    """vLLM's flag, accepted: no code from a model's directory ever runs here (transformers
    is always called without it); a warning says so."""
    enable_lora: bool = False
    """vLLM's flag: LoRA adapters are not supported, so it is refused (serve a checkpoint
    with the adapter merged into its weights)."""
    enable_auto_tool_choice: bool = False
    """vLLM's flag, accepted: tool_choice auto is always served here (vLLM needs the flag)."""
    tool_call_parser: str | None = None
    """vLLM's flag: the format the model writes calls in (server/tools.py): hermes (calls in
    `<tool_call>` blocks: Qwen's and Hermes' format, and SmolLM2's list of calls), mistral
    (`[TOOL_CALLS]` and a list of calls) or llama3_json (Llama 3's JSON calls, `;` between
    them) or pythonic (a Python list of calls: Llama 3.2's and 4's). None: the format the
    model's chat template shows. Another of vLLM's names is refused, naming these."""
    trust_request_chat_template: bool = False
    """vLLM's flag: a request may bring its own chat template (`chat_template`), rendered in
    transformers' sandboxed Jinja; off, such a request is a 400 (a template is code the
    server runs)."""
    reasoning_parser: str | None = None
    """vLLM's flag: split a reasoning model's thinking (`<think>` ... `</think>`) out of its
    chat replies into the message's `reasoning` (server/reasoning.py): qwen3 (thinking where
    the reply or its prompt opens the tag) or deepseek_r1 (the reply always starts thinking).
    None: the thinking stays in the content as the model wrote it."""
    return_tokens_as_token_ids: bool = False
    """vLLM's flag: logprobs name every token `token_id:<id>` unless a request says
    otherwise (its `return_tokens_as_token_ids`)."""
    enable_tokenizer_info_endpoint: bool = False
    """vLLM's flag: serve GET /tokenizer_info (the tokenizer's configuration, its chat
    template included); off, the route is a 404."""
    enable_request_id_headers: bool = False
    """vLLM's flag: every response carries an X-Request-Id header, the request's own (its
    X-Request-Id) or a new one."""
    enable_server_load_tracking: bool = False
    """vLLM's flag: serve GET /load, `{"server_load": N}`, N the generation requests being
    answered now (a load balancer's signal); off, the route is a 404."""
    enable_force_include_usage: bool = False
    """vLLM's flag: every stream carries its usage, whether or not the request asks
    (stream_options): each chunk the usage so far, and a last chunk with the whole."""
    root_path: str = ""
    """vLLM's flag: the path prefix a reverse proxy serves this server under (/llm: the API
    answers at /llm/v1/... as well as at /v1/...)."""
    structured_outputs_backend: str = "auto"
    """vLLM's --structured-outputs-config.backend: each of vLLM's names (auto, xgrammar,
    guidance, outlines, lm-format-enforcer) means this server's grammar engine,
    llguidance."""
    disaggregation_mode: str | None = None
    """Prefill and decode on separate servers (SGLang's flag; engine/kv_transfer.py):
    prefill (compute prompts and their first tokens, and hand their KV to a decode server
    over Mooncake's Transfer Engine), decode (go on from such handoffs), both, or null
    (colocated only, the default). `pypto router --prefill URL --decode URL` fronts them."""
    kv_transfer_config: str | dict[str, Any] | None = None
    """vLLM's spelling of disaggregation_mode, as JSON: {"kv_connector": "MooncakeConnector",
    "kv_role": "kv_producer" (prefill), "kv_consumer" (decode) or "kv_both", "kv_ip": the
    address to offer KV at, "kv_connector_extra_config": {"mooncake_protocol": "tcp" or
    "rdma"}}."""
    kv_transfer_host: str | None = None
    """The address this server's Transfer Engine offers KV at (default: kv_transfer_config's
    kv_ip, else --host where that is one address, else this machine's address on its route
    out)."""
    kv_transfer_protocol: str = "tcp"
    """The Transfer Engine's transport: tcp, or rdma where the machine has a device."""
    kv_transfer_timeout_s: float = 60.0
    """How long a prefill server keeps a handoff for its decode server to read (then frees
    it), and how long a decode server waits on a read (then computes the prompt itself)."""
    kv_transfer_store: str | None = None
    """mooncake://HOST:PORT: hand the KV over the Mooncake Store whose master is there (the
    prefill server puts it, the decode server gets it) instead of peer to peer over the
    Transfer Engine. vLLM's spelling: kv_connector "MooncakeStoreConnector" with
    kv_connector_extra_config {"master_server_address": "HOST:PORT"}."""

    def transfer(self) -> TransferSpec | None:
        """How this server takes part in disaggregated serving, from either spelling; None:
        colocated only."""
        mode = self.disaggregation_mode
        role = None if mode in (None, "null") else mode
        host, protocol = self.kv_transfer_host, self.kv_transfer_protocol
        store = self.kv_transfer_store
        raw = self.kv_transfer_config
        if raw is not None:
            try:
                kv = json.loads(raw) if isinstance(raw, str) else raw
                if not isinstance(kv, dict):
                    raise ValueError(type(kv).__name__)
            except ValueError as e:
                why = f"kv_transfer_config is not a JSON object: {e}"
                raise PyptoError(why, "kv_transfer_config") from None
            connector = kv.get("kv_connector", "MooncakeConnector")
            if connector not in KV_CONNECTORS:
                raise PyptoError(
                    f"kv_connector {connector!r} is not served here: the KV moves over "
                    f"Mooncake's Transfer Engine or Store ({', '.join(KV_CONNECTORS)})",
                    "kv_transfer_config",
                )
            kv_role = kv.get("kv_role")
            if kv_role not in KV_ROLES:
                raise PyptoError(
                    f"kv_role must be one of {', '.join(KV_ROLES)}, got {kv_role!r}",
                    "kv_transfer_config",
                )
            if role is not None and role != KV_ROLES[kv_role]:
                raise PyptoError(
                    f"disaggregation_mode {role} and kv_role {kv_role} disagree",
                    "disaggregation_mode",
                )
            role = KV_ROLES[kv_role]
            host = host or kv.get("kv_ip")
            extra = kv.get("kv_connector_extra_config") or {}
            protocol = str(extra.get("mooncake_protocol", protocol))
            if connector == STORE_CONNECTOR and store is None:
                master = extra.get("master_server_address")
                if not isinstance(master, str):
                    raise PyptoError(
                        f"kv_connector {STORE_CONNECTOR} needs kv_connector_extra_config."
                        "master_server_address (the Mooncake master, HOST:PORT)",
                        "kv_transfer_config",
                    )
                store = (
                    master
                    if master.startswith(f"{REMOTE_SCHEME}://")
                    else (f"{REMOTE_SCHEME}://{master}")
                )
        if role is not None and role not in KV_ROLES.values():
            raise PyptoError(
                f"disaggregation_mode must be prefill, decode, both or null, got {role!r}",
                "disaggregation_mode",
            )
        if protocol not in ("tcp", "rdma"):
            raise PyptoError(
                f"kv_transfer_protocol must be tcp or rdma, got {protocol!r}",
                "kv_transfer_protocol",
            )
        if store is not None:
            remote_address(store, "kv_transfer_store")
        return None if role is None else TransferSpec(role, host, protocol, store)

    def validate(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise PyptoError(f"port must be in [0, 65535], got {self.port!r}")
        for name in ("max_request_bytes", "max_header_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1024:
                raise PyptoError(f"{name} must be >= 1024, got {value!r}")
        if not self.log_interval_s > 0:
            raise PyptoError(f"log_interval_s must be > 0, got {self.log_interval_s!r}")
        if not isinstance(self.shutdown_timeout, int | float) or not self.shutdown_timeout >= 0:
            raise PyptoError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout!r}")
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise PyptoError(f"{name} must be > 0, got {value!r}")
        for name in ("max_connections", "max_connections_per_client", "max_response_logprobs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PyptoError(f"{name} must be an integer >= 1, got {value!r}")
        if self.api_key is not None and not self.api_key:
            raise PyptoError("api_key must not be empty")
        names = self.served_model_name
        if names is not None and (
            not names
            or not all(isinstance(n, str) and n for n in names)
            or len(set(names)) < len(names)
        ):
            raise PyptoError(
                f"served_model_name must be one or more different non-empty names, got {names!r}",
                "served_model_name",
            )
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise PyptoError(
                f"tool_call_parser {self.tool_call_parser!r} is not served here: give one of "
                f"{', '.join(TOOL_CALL_PARSERS)}, or leave it out (the format is read from the "
                "model's chat template)",
                "tool_call_parser",
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise PyptoError(
                f"reasoning_parser {self.reasoning_parser!r} is not served here: give one of "
                f"{', '.join(REASONING_PARSERS)} (both read <think> ... </think>), or leave it "
                "out (the thinking stays in the content)",
                "reasoning_parser",
            )
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise PyptoError(
                f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, got "
                f"{self.uvicorn_log_level!r}",
                "uvicorn_log_level",
            )
        if self.structured_outputs_backend not in GRAMMAR_BACKENDS:
            raise PyptoError(
                f"structured_outputs_backend must be one of {', '.join(sorted(GRAMMAR_BACKENDS))} "
                f"(each means llguidance here), got {self.structured_outputs_backend!r}",
                "structured_outputs_backend",
            )
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise PyptoError(
                f"root_path must start with / and not end with one, got {self.root_path!r}",
                "root_path",
            )
        if self.enable_lora:
            raise PyptoError(
                "enable_lora: LoRA adapters are not supported; merge the adapter into the "
                "model's weights (peft's merge_and_unload) and serve that checkpoint",
                "enable_lora",
            )
        for name in ("max_queued_requests", "max_queued_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise PyptoError(f"{name} must be an integer >= 0, got {value!r}")
        timeout = self.kv_transfer_timeout_s
        if not isinstance(timeout, int | float) or not timeout > 0:
            raise PyptoError(f"kv_transfer_timeout_s must be > 0, got {timeout!r}")
        self.transfer()


GRAMMAR_BACKENDS = frozenset(
    {"auto", "xgrammar", "guidance", "llguidance", "outlines", "lm-format-enforcer"}
)
"""vLLM's structured-output backend names: each means this server's llguidance."""
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
"""uvicorn's log levels (`ServerConfig.uvicorn_log_level`)."""
RUNNERS = ("auto", "generate", "pooling")
"""vLLM's --runner values (`EngineConfig.runner`)."""
STORE_CONNECTOR = "MooncakeStoreConnector"
KV_CONNECTORS = ("MooncakeConnector", "MooncakeConnectorV1", STORE_CONNECTOR)
"""vLLM's kv_connector names this server's handoffs answer to (engine/kv_transfer.py)."""
KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
"""vLLM's kv_role -> disaggregation_mode."""

REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""vLLM's --reasoning-parser names served here (`ServerConfig.reasoning_parser`)."""
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
"""vLLM's --tool-call-parser names this server reads (`ServerConfig.tool_call_parser`)."""

SERVE_ENGINE_DEFAULTS: dict[str, Any] = {"max_num_batched_tokens": 1024, "background_compile": True}
"""Engine defaults of `pypto serve` that differ from the offline ones: a smaller step budget
lets new requests reach their first token sooner under load (docs/performance.md: at
concurrency 16, TTFT median ~1.5 s instead of ~2.2 s at equal throughput), while offline
runs keep 2048 (W1 ~7% faster); a server answers while it compiles (a cold start's first
token in ~12 s instead of ~40 s), where an offline run waits to start at full speed."""


def read_config_file(path: Path) -> dict[str, Any]:
    """Flat knobs from a JSON config file: top-level fields, or grouped in "scheduler",
    "cache", "parallel" and "server" sections. Unknown names are an error (see `split_knobs`)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PyptoError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PyptoError(f"cannot read config file {path}: {e}") from None
    if not isinstance(data, dict):
        raise PyptoError(f"config file {path}: expected a JSON object")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in (*SECTION_NAMES, "server"):
            if not isinstance(value, dict):
                raise PyptoError(f"config file {path}: {key!r} must be an object")
            flat.update(value)
        else:
            flat[key] = value
    return flat


def split_knobs(knobs: dict[str, Any]) -> tuple[dict[str, Any], ServerConfig]:
    """(engine knobs, ServerConfig) from flat knobs; unknown names are an error."""
    server_names = {f.name for f in fields(ServerConfig)}
    known = set(knob_names()) | server_names
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise PyptoError(
            f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    given = {k: v for k, v in knobs.items() if k in server_names}
    if isinstance(given.get("served_model_name"), str):  # a config file's one name
        given["served_model_name"] = [given["served_model_name"]]
    server = ServerConfig(**given)
    server.validate()
    return {k: v for k, v in knobs.items() if k not in server_names}, server


def engine_config(**knobs: object) -> EngineConfig:
    """An EngineConfig from flat keyword knobs (engine, scheduler and cache fields alike)."""
    config = EngineConfig()
    targets: list[Any] = [config, config.scheduler, config.cache, config.parallel]
    for key, value in knobs.items():
        target = next((t for t in targets if key in {f.name for f in fields(t)}), None)
        if target is None or key in SECTION_NAMES:
            raise PyptoError(f"unknown engine option {key!r}; known: {', '.join(knob_names())}")
        setattr(target, key, value)
    config.validate()
    return config


def knob_names() -> list[str]:
    """Every flat knob name accepted by engine_config()."""
    sections = (EngineConfig, SchedulerConfig, CacheConfig, ParallelConfig)
    return [f.name for s in sections for f in fields(s) if f.name not in SECTION_NAMES]
