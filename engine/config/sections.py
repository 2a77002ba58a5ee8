"""The config's sections: frozen dataclasses that check their own values (``__post_init__``), and
how a YAML mapping becomes one (unknown keys are errors that list the known ones)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from engine.errors import ConfigError

from .checks import (I32_MAX, MIN_TEMPERATURE, MOD_LOG_MAX_CHARS, MOD_LOG_MIN_CHARS, SEED_MAX, DeviceName, DType,
                     _check_device, _DTYPES, is_int, is_real, require_fields)

__all__ = ["BackendConfig", "GenerationConfig", "StructuredConfig", "IngestConfig", "ActivationsConfig", "SAEConfig",
           "RayConfig", "RaylensConfig", "SECTIONS", "build_section", "GraphDecode"]

GraphDecode = Literal["auto", "static", "compile", "off"]  # backend.graph_decode's values


@dataclass(frozen=True)
class BackendConfig:
    """Which model runs where, and which internals are exposed to mods.

    ``hidden_state_layer`` is the layer whose residual-stream output (and attention pattern)
    events carry; its upper bound depends on the model and is checked when the model loads.
    """

    backend_type: Literal["huggingface"] = "huggingface"
    model_id: str = "meta-llama/Llama-3.1-8B-Instruct"
    device: DeviceName = "auto"
    dtype: DType = "auto"
    hidden_state_layer: int = 16
    extract_attention: bool = True
    extract_hidden_states: bool = True
    model_cache_dir: str | None = None  # where embedded models are converted to; None: user cache dir
    hf_token: str | None = field(default=None, repr=False)
    max_batch: int = 8  # requests that share one step; more wait in the queue (so do those the KV pool cannot hold)
    max_waiting: int = 256  # requests queued behind the active ones; then submit blocks (back-pressure)
    max_sequence: int | None = None  # positions per request (prompt + output); None: the model's context
    initial_cache_tokens: int = 256  # KV pool allocated up front per batch place (tokens); grows by doubling
    # decode forwards on static buffers: "auto" captures CUDA graphs on a GPU (eager elsewhere),
    # "static" runs the static-buffer path without capture, "compile" runs it through torch.compile
    # (a compile per decode shape; pays off on long CPU runs only), "off" is always eager
    graph_decode: GraphDecode = "auto"
    # linear layers on oneDNN-prepacked weights (engine/model/prepack.py): "auto" packs on a CPU
    # (float32/bfloat16; the packed copy costs the linear weights' size once more in memory), "off"
    # keeps torch's default GEMM
    weight_prepack: Literal["auto", "off"] = "auto"
    # graph_decode: compile keeps inductor's compiled kernels here, so they are built once per
    # machine (engine/model/compile_cache.py); None: <user cache dir>/raylens/inductor
    compile_cache_dir: str | None = None
    # attention reading the paged KV pool in place (engine/model/paged_attention.py): "auto" takes
    # torch's paged FlashAttention varlen kernel, else flash-attn's, on CUDA (float16/bfloat16,
    # kv_block_size a multiple of 256) and gathers each row's keys/values elsewhere; "reference"
    # is the same call in plain torch ops (slow: for checking); "off" always gathers
    paged_attention: Literal["auto", "torch", "flash_attn", "reference", "off"] = "auto"
    # tokens one step's forward may feed: every running request's next token first, then chunks
    # of new prompts up to this budget (a long prompt is prefilled over several steps, so no
    # stream waits for another request's whole prefill); at least max_batch, so decoding always fits
    max_step_tokens: int = 512
    # the paged KV cache: positions per block, and the pool's size in tokens (None: max_batch ×
    # max_sequence, which every request reserving its whole sequence fits; a smaller pool admits
    # requests while their reserved tokens — prompt + max_tokens — fit, and queues the rest)
    kv_block_size: int = 16
    kv_cache_tokens: int | None = None
    # reuse the keys/values (and captured internals) of a cached prompt prefix; a request's
    # `prefix_cache` overrides it
    prefix_caching: bool = True
    # the captured internals cached blocks keep (hidden and attention rows, so a hit gives mods and
    # stores what a fresh prefill would): at most this many MiB, least recently used evicted first;
    # attention rows grow with the square of the prefix (1 GiB per 4k-token prefix and attention
    # layer on an 8B model). null: no bound
    prefix_cache_rows_mb: int | None = 2048

    def __post_init__(self) -> None:
        if self.backend_type != "huggingface":
            raise ConfigError(f"`backend_type` must be 'huggingface', got {self.backend_type!r}",
                              parameter="backend_type", value=self.backend_type)
        if not self.model_id:
            raise ConfigError("`model_id` must be a non-empty string", parameter="model_id", value=self.model_id)
        _check_device(self.device)
        if self.dtype not in _DTYPES:
            raise ConfigError(f"`dtype` must be one of {', '.join(_DTYPES)}, got {self.dtype!r}",
                              parameter="dtype", value=self.dtype)
        require_fields(self, "", [
            ("hidden_state_layer", self.hidden_state_layer >= 0, ">= 0"),
            ("max_batch", isinstance(self.max_batch, int) and 1 <= self.max_batch <= 4096, "in [1, 4096]"),
            ("max_waiting", isinstance(self.max_waiting, int) and self.max_waiting >= 0, ">= 0"),
            ("max_sequence", self.max_sequence is None or self.max_sequence >= 2, ">= 2 or null"),
            ("initial_cache_tokens", self.initial_cache_tokens >= 1, ">= 1"),
            ("graph_decode", self.graph_decode in ("auto", "static", "compile", "off"),
             "one of auto, static, compile, off"),
            ("weight_prepack", self.weight_prepack in ("auto", "off"), "one of auto, off"),
            ("paged_attention", self.paged_attention in ("auto", "torch", "flash_attn", "reference", "off"),
             "one of auto, torch, flash_attn, reference, off"),
            ("max_step_tokens", isinstance(self.max_step_tokens, int) and not isinstance(self.max_step_tokens, bool)
             and self.max_step_tokens >= (self.max_batch if isinstance(self.max_batch, int) else 1),
             f">= max_batch ({self.max_batch}: every running request feeds one token per step); raise it or "
             f"lower max_batch"),
            ("kv_block_size", is_int(self.kv_block_size) and 1 <= self.kv_block_size <= 1024, "in [1, 1024]"),
            ("kv_cache_tokens", self.kv_cache_tokens is None or (
                is_int(self.kv_cache_tokens) and is_int(self.kv_block_size)
                and self.kv_cache_tokens >= 2 * self.kv_block_size),
             f">= 2 * kv_block_size ({2 * self.kv_block_size if is_int(self.kv_block_size) else 2}) or null"),
            ("prefix_caching", isinstance(self.prefix_caching, bool), "true or false"),
            ("prefix_cache_rows_mb", self.prefix_cache_rows_mb is None or (
                is_int(self.prefix_cache_rows_mb) and self.prefix_cache_rows_mb >= 0), ">= 0 or null"),
        ])


@dataclass(frozen=True)
class GenerationConfig:
    """Default sampling parameters; every one can be overridden per request.

    ``top_k = 0`` and ``top_p = 1`` disable those filters; ``temperature = 0`` is greedy.
    ``step_limit`` bounds loop iterations, because Backtrack can erase tokens and a mod could
    otherwise keep a request alive forever (None: ``4 * max_tokens + 64``).
    ``mod_call_timeout_s``: a mod call that has not returned by then ends its request with finish
    reason ``error`` and frees its batch slot (the stuck call is abandoned; None or 0: no limit).
    ``mod_dirs``: the only directories directory-form mod payloads may load from (none by default:
    a payload naming a path runs code from this machine's disk, so the operator opts in).
    ``keep_logits``: whether a result's ForwardPass events keep their step's logits once the step
    is over. Mods and ``on_event`` listeners read them live either way. Off by default (as HF's
    ``generate`` keeps no per-step logits unless asked): kept, every step's ``(batch, vocabulary)``
    logits stay in memory (on a GPU, device memory) until the batch's results are dropped, and
    every step's host copy for mods lands in fresh memory.
    ``payload_top_tokens``: whether a request's ingest payload lists, for each ForwardPass, the
    step's 20 most likely next tokens with their log-probs. They cost a log-softmax and a top-k
    over the whole vocabulary on every step (on a CPU, a sixth of a small model's step at 8 to
    32 requests), so by default (null) they are computed only when the engine sends payloads
    (``ingest.url`` set); true computes them for every request (a caller that reads
    ``GenerationResult.payload`` itself and wants them), false for none. The ``top_logprobs``
    a request asks for are computed either way.
    """

    max_tokens: int = 2048
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50
    stop_tokens: tuple[int, ...] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    step_limit: int | None = None
    mod_call_timeout_s: float | None = 30.0
    mod_dirs: tuple[str, ...] = ()
    keep_logits: bool = False
    payload_top_tokens: bool | None = None

    def __post_init__(self) -> None:
        require_fields(self, "", [
            ("keep_logits", isinstance(self.keep_logits, bool), "true or false"),
            ("payload_top_tokens", self.payload_top_tokens is None or isinstance(self.payload_top_tokens, bool),
             "true, false or null (null: only when payloads are sent, ingest.url set)"),
            ("mod_call_timeout_s", self.mod_call_timeout_s is None or (
                is_real(self.mod_call_timeout_s) and math.isfinite(self.mod_call_timeout_s)
                and self.mod_call_timeout_s >= 0), "a finite number >= 0 (0 or null: no limit)"),
            ("mod_dirs", isinstance(self.mod_dirs, (tuple, list)) and all(isinstance(d, str) for d in self.mod_dirs),
             "a list of directory paths"),
        ])
        # Types first, so a string or a float from a JSON request gets our message, not a TypeError.
        # Integers are bounded by the ingest schema (32-bit signed) and seeds by torch.Generator
        # (64-bit unsigned); floats must be finite, since NaN compares false with every bound.
        max_tokens, top_k, step_limit, seed = self.max_tokens, self.top_k, self.step_limit, self.seed
        require_fields(self, "", [
            ("max_tokens", is_int(max_tokens), "an integer"),
            ("max_tokens", not is_int(max_tokens) or max_tokens >= 1, ">= 1"),
            ("max_tokens", not is_int(max_tokens) or max_tokens <= I32_MAX, f"<= {I32_MAX} (32 bits)"),
            ("temperature", is_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
             ">= 0 and finite (0 is greedy)"),
            # a vanishing temperature is refused, never lifted to a floor behind the caller's back
            ("temperature", not (is_real(self.temperature) and 0 < self.temperature < MIN_TEMPERATURE),
             f"0 (greedy) or >= {MIN_TEMPERATURE:g}"),
            ("top_p", is_real(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", is_int(top_k) and 0 <= top_k <= I32_MAX, f">= 0 and <= {I32_MAX} (0 disables top-k)"),
            ("step_limit", step_limit is None or (is_int(step_limit) and 1 <= step_limit <= I32_MAX),
             f">= 1 and <= {I32_MAX}, or null"),
            ("seed", seed is None or (is_int(seed) and 0 <= seed <= SEED_MAX), ">= 0 and <= 2**64 - 1 (64 bits), or null"),
            ("stop_tokens", self.stop_tokens is None or (isinstance(self.stop_tokens, (tuple, list)) and all(
                is_int(t) and 0 <= t <= I32_MAX for t in self.stop_tokens)),
             f"a list of token ids in [0, {I32_MAX}] or null"),
        ])

    @property
    def effective_step_limit(self) -> int:
        return self.step_limit if self.step_limit is not None else 4 * self.max_tokens + 64


@dataclass(frozen=True)
class StructuredConfig:
    """What one structured request's grammar (``response_format``, an enforced ``tool_choice``)
    may cost. A grammar is native code's input (llguidance): a long enough chain of rules
    overflows its compiler's stack and kills the process, and a grammar's per-step work has no
    bound of its own. So its text is bounded first (``max_grammar_bytes``, ``max_grammar_rules``:
    Lark rule and terminal definitions, or JSON-schema objects), it is compiled and its first step
    taken in a child process (``compile_workers`` of them, reused) within ``compile_timeout_s``,
    and the remaining keys are llguidance's own limits (its ``LLParserLimits``), applied to the
    compile and to every step's mask: past one, the request fails with an error naming its
    grammar's field, never the process. Defaults are llguidance 1.9's own, stated here so that a
    library upgrade cannot change them."""

    max_grammar_bytes: int = 131_072
    max_grammar_rules: int = 2_000
    compile_timeout_s: float = 10.0
    compile_workers: int = 1
    max_items_in_row: int = 2_000  # branching of one Earley row
    initial_lexer_fuel: int = 1_000_000  # building the lexer's regexes (~50k per ms)
    step_lexer_fuel: int = 200_000  # the lexer's work in one step's mask (~14k per ms)
    step_max_items: int = 50_000  # Earley items in one step's mask (~20k per ms)
    max_lexer_states: int = 250_000  # lexer states (1-2 kB each)
    max_grammar_size: int = 500_000  # symbols in the compiled grammar's productions

    def __post_init__(self) -> None:
        positive = ("max_grammar_bytes", "max_grammar_rules", "compile_workers", "max_items_in_row",
                    "initial_lexer_fuel", "step_lexer_fuel", "step_max_items", "max_lexer_states", "max_grammar_size")
        require_fields(self, "structured.", [
            *[(name, is_int(getattr(self, name)) and 1 <= getattr(self, name) <= I32_MAX,
               f"an integer in [1, {I32_MAX}]") for name in positive],
            ("compile_workers", not is_int(self.compile_workers) or self.compile_workers <= 16, "at most 16"),
            ("compile_timeout_s", is_real(self.compile_timeout_s) and math.isfinite(self.compile_timeout_s)
             and self.compile_timeout_s > 0, "a finite number > 0"),
        ])


@dataclass(frozen=True)
class IngestConfig:
    """Where per-request observability payloads go.

    ``url`` None: payloads are not sent; each is built when its ``GenerationResult.payload`` is
    first read. Failed sends are written to ``spool_dir`` and replayed later, never dropped.

    ``mod_log_max_chars_per_call`` / ``mod_log_max_chars_per_request`` bound what mods printed or
    logged in one payload. The backend refuses bodies over 75 MiB (HTTP 413), and one chatty mod
    can print that much; past a limit the text is cut and a marker entry says how many characters
    and entries were cut. Each log entry counts its message plus a fixed
    ``MOD_LOG_ENTRY_OVERHEAD`` (its record's other fields), so a flood of empty lines is bounded
    too. JSON escaping can grow a character to at most 6 bytes, so the defaults keep a payload's
    logs under ~6 MiB.
    """

    url: str | None = None
    timeout_s: float = 5.0
    retries: int = 3
    spool_dir: str = "./artifacts/ingest-spool"
    # deliveries a spooled payload may fail with the same answer from the backend (a 5xx other
    # than 502/503/504, which say "not now") before it goes to spool/rejected/ with that answer
    reject_after: int = 3
    mod_log_max_chars_per_call: int = 16_384
    mod_log_max_chars_per_request: int = 1_048_576

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"`ingest.url` must start with http:// or https://, got {self.url!r}",
                              parameter="url", value=self.url)
        require_fields(self, "ingest.", [
            ("timeout_s", self.timeout_s > 0, "> 0"), ("retries", self.retries >= 0, ">= 0"),
            ("reject_after", is_int(self.reject_after) and 1 <= self.reject_after <= 1000, "an integer in [1, 1000]"),
            ("mod_log_max_chars_per_call", is_int(self.mod_log_max_chars_per_call)
             and MOD_LOG_MIN_CHARS <= self.mod_log_max_chars_per_call <= MOD_LOG_MAX_CHARS,
             f"an integer in [{MOD_LOG_MIN_CHARS}, {MOD_LOG_MAX_CHARS}] (room for the truncation marker; "
             "under the backend's 75 MiB body limit)"),
            ("mod_log_max_chars_per_request", is_int(self.mod_log_max_chars_per_request)
             and self.mod_log_max_chars_per_call <= self.mod_log_max_chars_per_request <= MOD_LOG_MAX_CHARS,
             f"an integer in [ingest.mod_log_max_chars_per_call, {MOD_LOG_MAX_CHARS}]"),
        ])


@dataclass(frozen=True)
class ActivationsConfig:
    """The local activation store: a DuckDB file (single writer) plus Parquet exports."""

    enabled: bool = False
    db_path: str = "./artifacts/activations/activations.duckdb"
    parquet_path: str = "./artifacts/activations/parquet/"
    retention_days: int = 14
    threads: int = 2  # DuckDB worker threads
    memory_limit: str = "1GB"

    def __post_init__(self) -> None:
        require_fields(self, "activations.", [("retention_days", self.retention_days >= 1, ">= 1"),
                                        ("threads", self.threads >= 1, ">= 1")])


@dataclass(frozen=True)
class SAEConfig:
    """SAE feature extraction. ``sae_id``: a name in ``engine.services.sae.SAE_REGISTRY`` or an SAE directory
    in sae-lens format. ``nearline`` encodes on a background worker in blocks of ``block_steps``
    forward passes (at most ``max_pending_blocks`` waiting: then the token loop waits, nothing is
    dropped); ``inline`` encodes inside the token loop. A block whose hand-off fails is tried
    ``retry_attempts`` times in all, ``retry_backoff_s`` (doubling) apart, whichever transport
    carries it, then recorded in ``missing_blocks``."""

    enabled: bool = False
    mode: Literal["nearline", "inline"] = "nearline"
    sae_id: str = "llama_scope_lxr_8x"
    layer: int = 16
    top_k: int = 20
    device: DeviceName = "auto"  # auto: the model's device
    dtype: DType = "float32"
    block_steps: int = 16
    max_pending_blocks: int = 64
    skip_first_position: bool = True  # position 0 is an attention sink; SAEs are trained without it
    retry_attempts: int = 3
    retry_backoff_s: float = 0.05
    neuronpedia_url: str | None = None  # feature explanations; off unless set

    def __post_init__(self) -> None:
        _check_device(self.device)
        require_fields(self, "sae.", [("layer", self.layer >= 0, ">= 0"), ("top_k", self.top_k >= 1, ">= 1"),
                                 ("block_steps", self.block_steps >= 1, ">= 1"),
                                 ("max_pending_blocks", self.max_pending_blocks >= 1, ">= 1"),
                                 ("retry_attempts", self.retry_attempts >= 1, ">= 1"),
                                 ("retry_backoff_s", is_real(self.retry_backoff_s) and math.isfinite(
                                     self.retry_backoff_s) and self.retry_backoff_s >= 0, "a finite number >= 0")])
        if self.mode not in ("nearline", "inline"):
            raise ConfigError(f"`sae.mode` must be nearline or inline, got {self.mode!r}", parameter="mode",
                              value=self.mode)


@dataclass(frozen=True)
class RayConfig:
    """The Ray deployment: actor counts, resources and bounds (read by pipelines/cluster/actor_specs.py).

    ``sae_worker_resource`` names a custom resource SAE workers require, so they run only on nodes
    that offer it (e.g. ``sae_gpu`` on a second GPU box, see ray_cluster.yaml); None places them
    anywhere. ``max_inflight_blocks`` bounds hidden-state blocks a generator has handed to SAE
    workers and not yet seen stored: at the bound the token loop waits (back-pressure).
    ``actor_start_timeout_s`` bounds the wait for new actors to be placed and constructed (the
    generator loads its model then), so a request no node can meet fails instead of hanging.
    ``generators`` GeneratorActor replicas (one per GPU or node) share a job's requests, each
    running ``generator_max_concurrency`` at a time. ``connect_timeout_s`` bounds reaching the
    cluster or its dashboard, so a wrong address is one line at once, not minutes of retries.

    Replicas (``pipelines/cluster/router.py``): ``router`` picks where each request runs —
    ``affinity`` sends it to the replica whose prefix cache holds most of its leading blocks (load
    breaks ties), ``round_robin`` takes turns. A replica with ``router_queue_bound`` requests in
    flight (None: ``generator_max_concurrency``) is skipped while another has room.
    ``router_refresh_s``: at most how often a router reads each replica's cache events and load
    (it reads them as it routes).
    ``generator_resource`` names a custom resource each generator replica requires (one unit), so
    replicas land one per node that offers one unit of it; None places them anywhere.
    """

    namespace: str = "raylens"
    address: str = "auto"
    dashboard_url: str = "http://127.0.0.1:8265"
    generator_num_cpus: float = 1.0
    generator_num_gpus: float = 0.0
    generator_max_concurrency: int = 4
    generators: int = 1
    generator_resource: str | None = None
    router: Literal["affinity", "round_robin"] = "affinity"
    router_queue_bound: int | None = None
    router_refresh_s: float = 0.1
    sae_workers: int = 2
    sae_worker_num_cpus: float = 1.0
    sae_worker_num_gpus: float = 0.0
    sae_worker_resource: str | None = None
    max_inflight_blocks: int = 8
    store_num_cpus: float = 0.5
    ingest_num_cpus: float = 0.25
    ingest_batch_size: int = 16
    ingest_flush_interval_s: float = 2.0
    call_timeout_s: float = 120.0
    actor_start_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        require_fields(self, "ray.", [("sae_workers", self.sae_workers >= 1, ">= 1"),
                                ("generators", self.generators >= 1, ">= 1"),
                                ("router", self.router in ("affinity", "round_robin"), "affinity or round_robin"),
                                ("router_queue_bound", self.router_queue_bound is None or (
                                    is_int(self.router_queue_bound) and self.router_queue_bound >= 1), ">= 1 or null"),
                                ("router_refresh_s", is_real(self.router_refresh_s) and math.isfinite(
                                    self.router_refresh_s) and self.router_refresh_s > 0, "a finite number > 0"),
                                ("connect_timeout_s", self.connect_timeout_s > 0, "> 0"),
                                ("max_inflight_blocks", self.max_inflight_blocks >= 1, ">= 1"),
                                ("generator_max_concurrency", self.generator_max_concurrency >= 1, ">= 1"),
                                ("ingest_batch_size", self.ingest_batch_size >= 1, ">= 1"),
                                ("ingest_flush_interval_s", self.ingest_flush_interval_s > 0, "> 0"),
                                ("call_timeout_s", self.call_timeout_s > 0, "> 0"),
                                ("actor_start_timeout_s", self.actor_start_timeout_s > 0, "> 0")])


@dataclass(frozen=True)
class RaylensConfig:
    backend: BackendConfig = field(default_factory=BackendConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    sae: SAEConfig = field(default_factory=SAEConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    source: str | None = None  # the YAML file it came from, for messages

    def with_paths_under(self, base: str | Path) -> "RaylensConfig":
        """The same config with relative file paths made absolute under ``base`` — needed where the
        working directory is a throwaway copy (a Ray Job's) but the data must outlive it."""
        root = Path(base)

        def absolute(path: str) -> str:
            return path if Path(path).is_absolute() else str((root / path).resolve())

        def absolute_or_none(path: str | None) -> str | None:
            return None if path is None else absolute(path)

        sae_id = self.sae.sae_id
        if ("/" in sae_id or sae_id.startswith(".")) and not Path(sae_id).is_absolute():
            sae_id = absolute(sae_id)
        return dataclasses.replace(
            self,
            activations=dataclasses.replace(self.activations, db_path=absolute(self.activations.db_path),
                                            parquet_path=absolute(self.activations.parquet_path)),
            ingest=dataclasses.replace(self.ingest, spool_dir=absolute(self.ingest.spool_dir)),
            backend=dataclasses.replace(self.backend, model_cache_dir=absolute_or_none(self.backend.model_cache_dir),
                                        compile_cache_dir=absolute_or_none(self.backend.compile_cache_dir)),
            sae=dataclasses.replace(self.sae, sae_id=sae_id),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain sections, e.g. to hand to Ray actors (``from_dict`` rebuilds it)."""
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "source"}

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, Any]]) -> "RaylensConfig":
        return cls(**{name: build_section(name, SECTIONS[name], values) for name, values in data.items()})

    def __post_init__(self) -> None:
        if self.sae.enabled and not self.activations.enabled:
            raise ConfigError("`sae.enabled` needs `activations.enabled`: SAE features are written to the "
                              "activation store (set CONCORDANCE_ACTIVATIONS_ENABLED=true)", parameter="sae.enabled")


SECTIONS: dict[str, type] = {"backend": BackendConfig, "generation": GenerationConfig, "structured": StructuredConfig,
                              "ingest": IngestConfig, "activations": ActivationsConfig, "sae": SAEConfig,
                              "ray": RayConfig}


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(str(v) for v in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if origin is tuple:
        return "a list of integers"
    return _TYPE_WORDS.get(hint, getattr(hint, "__name__", str(hint)))


def _coerce(section: str, cls: type, key: str, value: Any) -> Any:
    """Check a YAML value against the field's annotation; lists become tuples."""
    hints = typing.get_type_hints(cls)
    hint = hints[key]
    args = typing.get_args(hint)
    allowed = args if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None and type(None) in allowed:
        return None
    for option in allowed:
        origin = typing.get_origin(option)
        if origin is tuple and isinstance(value, (list, tuple)):
            return tuple(int(v) for v in value)
        if origin is Literal and isinstance(value, bool):
            # YAML 1.1 reads a bare `off` / `on` as a bool: a mode named so means that word
            word = "on" if value else "off"
            if word in typing.get_args(option):
                return word
        elif origin is Literal and value in typing.get_args(option):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option in (int, str, bool) and type(value) is option:
            return value
    raise ConfigError(f"`{section}.{key}` must be {_describe(hint)}, got {value!r}", parameter=f"{section}.{key}",
                      value=value)


def build_section(section: str, cls: type, values: Mapping[str, Any]) -> Any:
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(f'{section}.{k}' for k in unknown)}; known keys of `{section}`: "
            f"{', '.join(known)}",
            parameter=section,
            value=unknown,
        )
    return cls(**{k: _coerce(section, cls, k, v) for k, v in values.items()})
