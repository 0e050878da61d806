"""Engine configuration: what to run, how to split it, and how to speculate."""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from atom.distributed.node_layout import NodeLayout, torchrun_settings
from atom.model_ops.quantization.config import QuantizationConfig
from atom.utils.arithmetic import ceil_div

if TYPE_CHECKING:
    import torch

    from atom.kv_transfer.config import KVTransferConfig

# `--kv-role` alone makes only a context-only producer (placement, no proposals);
# a decode node (kv_consumer) receives KV, so it needs `--kv-transfer-config`,
# which names the connector and sets the role of either side (docs/pd.md).
KV_ROLES = ("none", "kv_producer")
TRANSFER_ONLY_KV_ROLES = ("kv_consumer",)
# Only methods with a drafter (`spec_decode/factory.py`) are offered.
SPECULATIVE_METHODS = ("dspark",)
# Names of torch dtypes: torch is imported only where a dtype is resolved, so that
# the command line builds its flags from this module without loading torch.
DTYPES = ("float32", "bfloat16", "float16")
# The paged KV cache's row dtype: auto = the model dtype; fp8 (alias fp8_e4m3) =
# float8_e4m3fn rows with a per-layer scale (`model_ops/paged_cache.py`).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Settings the environment may give when the caller leaves them unset; read here only,
# so no layer consults the environment and the start-up log shows what was chosen.
PARTITION_ENV_VARS = ("ATOM_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION")
KDA_BACKEND_ENV_VAR = "ATOM_KDA_BACKEND"
# auto: triton on CUDA (fla prefill when importable), else torch (`model_ops/kda_backend.py`).
KDA_BACKENDS = ("auto", "torch", "fla", "triton")
ATTENTION_BACKEND_ENV_VAR = "ATOM_ATTENTION_BACKEND"
# auto: triton on CUDA, else torch (`model_ops/attention_backend.py`).
ATTENTION_BACKENDS = ("auto", "torch", "triton")


# One fact, two spellings: transformers 5 writes `dtype` (and, for Kimi Linear,
# `model_max_length`); older writers and the published checkpoints the first name.
DTYPE_FIELDS = ("torch_dtype", "dtype")
CONTEXT_LENGTH_FIELDS = ("max_position_embeddings", "model_max_length")


class HFConfig(dict):
    """Attribute view of a checkpoint's config.json (nested dicts become HFConfig)."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(f"config has no field {name!r}") from None
        return HFConfig(value) if isinstance(value, dict) else value

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def first_of(self, names: tuple[str, ...]) -> Any:
        """The value of the first of `names` that is set (None if none is)."""
        return next((self[n] for n in names if self.get(n) is not None), None)

    @property
    def text(self) -> HFConfig:
        """The language-model config: `text_config` for multimodal wrappers."""
        if isinstance(self.get("text_config"), dict):
            return HFConfig(self["text_config"])
        return self

    @property
    def architecture(self) -> str:
        archs = self.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        return archs[0]


def load_hf_config(model_dir: str) -> HFConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no config.json in model folder {model_dir!r}")
    with open(path) as f:
        return HFConfig(json.load(f))


@dataclass(frozen=True)
class ParallelConfig:
    """The rank layout: global rank = pp_rank * tensor_parallel_size + tp_rank."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class EngineLimits:
    """Batch limits and cache sizes, decided once (`Config.limits`) and shared by the
    scheduler and every rank's runner, so no two places size the caches apart."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    # Drafts verified per decoding step (0 without speculation).
    num_speculative_tokens: int = 0
    # Recurrent-state slots after the request slots that keep the state at a cached
    # prompt boundary, so a later request can resume that prefix.
    num_state_checkpoints: int = 0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Schedule step n + 1 before step n's tokens are on the host (run_ahead.py).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_speculative_tokens", "num_state_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_state_checkpoints and not self.enable_prefix_caching:
            raise ValueError("state checkpoints serve prefix caching, which is off")
        if self.max_num_batched_tokens < self.num_speculative_tokens + 1:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold "
                f"one verify of {self.num_speculative_tokens + 1} rows"
            )
        if (
            not self.enable_chunked_prefill
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "without chunked prefill max_num_batched_tokens="
                f"{self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len}"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        """KV blocks one sequence may hold: the drafter's block rows sit after the
        last verify row, so positions reach max_model_len - 2 + T."""
        longest = self.max_model_len - 1 + self.num_speculative_tokens
        return ceil_div(longest, self.block_size)

    @property
    def num_state_slots(self) -> int:
        """Request slots 0..max_num_seqs-1, then the checkpoint slots."""
        return self.max_num_seqs + self.num_state_checkpoints

    def check_draft_room(
        self, room_bytes: int, block_bytes: int, row_bytes: int
    ) -> None:
        """Refuse a draft count whose state snapshots crowd the KV blocks of one
        sequence out of `room_bytes` (what states and KV blocks may take together),
        naming the largest count that fits. `row_bytes` is one state row of every
        slot: a slot keeps its state and a snapshot per verify row (drafts + 2)."""
        drafts = self.num_speculative_tokens

        def fits(count: int) -> bool:
            blocks = ceil_div(self.max_model_len - 1 + count, self.block_size)
            return (count + 2) * row_bytes + blocks * block_bytes <= room_bytes

        if not drafts or not row_bytes or fits(drafts):
            return
        # fits() only turns false as the count grows: the fitting counts lead.
        largest = bisect.bisect_left(range(1, drafts), True, key=lambda c: not fits(c))
        if largest == 0:  # not even one draft fits: check_kv_blocks says what does
            return
        raise ValueError(
            f"num_speculative_tokens={drafts} (--num-speculative-tokens) is too "
            "large for the cache: the recurrent states keep a snapshot per verify "
            f"row, {(drafts + 2) * row_bytes / 2**30:.2f} GiB for "
            f"{self.num_state_slots} state slots, which leaves no room in "
            f"{room_bytes / 2**30:.2f} GiB for the {self.max_blocks_per_seq} KV "
            f"blocks of one sequence of max_model_len={self.max_model_len}; at most "
            f"{largest} draft tokens fit (or lower --max-num-seqs)"
        )

    def check_kv_blocks(self, num_kv_blocks: int) -> None:
        """Refuse a KV cache too small for one sequence of max_model_len."""
        if num_kv_blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"one sequence of max_model_len={self.max_model_len} needs "
                f"{self.max_blocks_per_seq} KV blocks of {self.block_size} tokens but "
                f"the cache has {num_kv_blocks}; lower max_model_len or give the "
                "cache more memory"
            )


@dataclass
class SpeculativeConfig:
    method: str
    model: str | None = None
    num_speculative_tokens: int = 1
    draft_hf_config: HFConfig | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"unknown speculative method {self.method!r}; "
                f"allowed: {', '.join(SPECULATIVE_METHODS)}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                "num_speculative_tokens must be >= 1, "
                f"got {self.num_speculative_tokens}"
            )
        if not self.model:
            raise ValueError(
                f"method {self.method!r} needs a draft model (draft_model)"
            )


@dataclass
class EngineSettings:
    """What a user chooses for an engine. `Config` builds on these fields and the
    command line (`EngineArgs`) exposes them, so each default lives here once."""

    model: str = "tiny-kimi-k3"
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    # Each running sequence holds a KDA recurrent-state slot that is allocated
    # up front; 64 matches the Kimi-K3 recipes and keeps that pool small on CPU.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 16384
    block_size: int = 16
    num_kvcache_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # While sequences decode, a new prompt waits factor x the last prefill step
    # (model_engine/prefill_pacer.py); 0 admits it at once.
    scheduler_delay_factor: float = 0.0
    # Overlap the host's work on one step with the device's on the next
    # (model_engine/run_ahead.py); tp = pp = 1 without speculation or P/D. None: on
    # wherever it runs on a GPU (on CPU the host is the device: nothing overlaps).
    async_scheduling: bool | None = None
    # Capture decode steps and short prefills as CUDA graphs (CUDA only); True runs
    # every step eagerly.
    enforce_eager: bool = False
    # Batch sizes to capture; None: the default ladder up to max_num_seqs.
    cudagraph_capture_sizes: list[int] | None = None
    # Token counts of one-prompt prefills to capture (model_engine/cuda_graph.py):
    # an eager short prefill is host-bound (hundreds of launches for a few ms of
    # GPU work). Past 256 rows a KDA prefill leaves the decode kernels, and the
    # device's time outweighs the host's anyway. Empty: every prefill eager.
    prefill_capture_sizes: tuple[int, ...] = (16, 32, 64, 128, 256)
    kv_role: str = "none"
    # JSON text or object (`kv_transfer/config.py`); None: no KV moves between engines.
    kv_transfer_config: str | dict | None = None
    pp_layer_partition: list[int] | None = None
    method: str | None = None
    draft_model: str | None = None
    # Drafts per decoding step; 0 once a Config is built without a speculative method.
    num_speculative_tokens: int = 1
    # ATOM's online quantization JSON, e.g. '{"global_quant_config": "ptpc_fp8"}'
    # (a string or a mapping); None keeps the checkpoint's weights as stored.
    online_quant_config: str | dict | None = None
    # KV_CACHE_DTYPES: what the paged KV rows are stored in; KDA states keep theirs.
    kv_cache_dtype: str = "auto"
    # More than one machine: node 0 serves, the others run ranks. NodeLayout
    # (node_layout.py) owns these settings' meaning and defaults.
    nnodes: int = NodeLayout.nnodes
    node_rank: int = NodeLayout.node_rank
    master_addr: str | None = NodeLayout.master_addr
    master_port: int | None = NodeLayout.master_port
    dist_interface: str | None = NodeLayout.dist_interface
    join_timeout: float = NodeLayout.join_timeout
    node_timeout: float = NodeLayout.node_timeout


@dataclass
class Config(EngineSettings):
    """The settings, resolved: the checkpoint's config and the speculative config."""

    seed: int = 0
    hf_config: HFConfig = field(default_factory=HFConfig)
    # Where KDA recurrences run; None: $ATOM_KDA_BACKEND, else auto.
    kda_backend: str | None = None
    # Where paged attention runs; None: $ATOM_ATTENTION_BACKEND, else auto.
    attention_backend: str | None = None
    # Built from method, draft_model and num_speculative_tokens.
    speculative_config: SpeculativeConfig | None = field(default=None, init=False)
    # Parsed from kv_transfer_config.
    kv_transfer: KVTransferConfig | None = field(default=None, init=False)
    # Set under torchrun, whose agent serves the rendezvous store itself.
    store_hosted_elsewhere: bool = field(default=False, init=False)
    # Built once from the settings above; the scheduler and every runner share it.
    limits: EngineLimits = field(init=False, repr=False, compare=False)
    # online_quant_config and the checkpoint's quantization_config, parsed once.
    quantization: QuantizationConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from atom.models.tiny import resolve_model_path

        self._resolve_kv_transfer()
        if self.kv_role not in KV_ROLES + TRANSFER_ONLY_KV_ROLES:
            raise ValueError(
                f"unknown kv_role {self.kv_role!r}; allowed: {', '.join(KV_ROLES)}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if not self.scheduler_delay_factor >= 0:  # NaN too
            raise ValueError(
                f"scheduler_delay_factor must be >= 0, got {self.scheduler_delay_factor}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; allowed: "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        self._resolve_environment()
        self.model = resolve_model_path(self.model)
        if not self.hf_config:
            self.hf_config = load_hf_config(self.model)
        if self.method is None:
            self.num_speculative_tokens = 0
        else:
            draft = resolve_model_path(self.draft_model) if self.draft_model else None
            self.speculative_config = SpeculativeConfig(
                method=self.method,
                model=draft,
                num_speculative_tokens=self.num_speculative_tokens,
                draft_hf_config=load_hf_config(draft) if draft else None,
            )
        text = self.hf_config.text
        self.quantization = QuantizationConfig.parse(
            self.online_quant_config, text.get("quantization_config")
        )
        if self.max_model_len is None:
            self.max_model_len = int(text.first_of(CONTEXT_LENGTH_FIELDS) or 4096)
        if self.nnodes == 1:
            for name, value in torchrun_settings(os.environ).items():
                setattr(self, name, value)
        # Building them validates the rank layout, the nodes and every limit.
        _ = self.parallel_config, self.node_layout
        self._resolve_async_scheduling()
        self.limits = self._build_limits()
        self._validate_parallel(text)

    def _resolve_async_scheduling(self) -> None:
        """Async scheduling fills a step's inputs (and, with speculation, its
        positions after the previous verify) from the previous step's tokens on the
        same device, and keeps one step ahead. Asked for, it refuses a setting it
        cannot run with; left at None, it runs wherever it can on a GPU."""
        conflicts = []
        if self.parallel_config.world_size > 1:
            conflicts.append(
                f"tensor_parallel_size={self.tensor_parallel_size} and "
                f"pipeline_parallel_size={self.pipeline_parallel_size} (it needs 1 and 1)"
            )
        if self.kv_transfer is not None:
            conflicts.append(f"kv_role {self.kv_role!r} (P/D)")
        if self.async_scheduling is None:
            self.async_scheduling = not conflicts and self.torch_device.type == "cuda"
        elif self.async_scheduling and conflicts:
            raise ValueError(
                "async_scheduling does not run with " + "; ".join(conflicts)
            )

    def _resolve_kv_transfer(self) -> None:
        """The P/D role: kv_transfer_config's kv_role, which kv_role may repeat."""
        if self.kv_transfer_config is None:
            if self.kv_role in TRANSFER_ONLY_KV_ROLES:
                raise ValueError(
                    f"kv_role {self.kv_role!r} receives KV from a producer, so it "
                    "needs --kv-transfer-config naming the connector, e.g. "
                    '\'{"kv_role": "kv_consumer", "kv_connector": "mooncake"}\''
                )
            return
        from atom.kv_transfer.config import KVTransferConfig
        from atom.kv_transfer.factory import check_connector_name

        self.kv_transfer = KVTransferConfig.parse(self.kv_transfer_config)
        check_connector_name(self.kv_transfer)
        if self.kv_role not in ("none", self.kv_transfer.kv_role):
            raise ValueError(
                f"kv_role {self.kv_role!r} contradicts kv_transfer_config's "
                f"kv_role {self.kv_transfer.kv_role!r}"
            )
        self.kv_role = self.kv_transfer.kv_role

    def _resolve_environment(self) -> None:
        """Fill the settings the caller left unset from the environment, and check
        them; a value the caller gave wins over the environment."""
        if self.pp_layer_partition is None:
            text = next(
                (os.environ[v] for v in PARTITION_ENV_VARS if os.environ.get(v)), None
            )
            self.pp_layer_partition = text
        if isinstance(self.pp_layer_partition, str):
            self.pp_layer_partition = parse_partition(self.pp_layer_partition)
        self.kda_backend = _backend_setting(
            "kda_backend", self.kda_backend, KDA_BACKEND_ENV_VAR, KDA_BACKENDS
        )
        self.attention_backend = _backend_setting(
            "attention_backend",
            self.attention_backend,
            ATTENTION_BACKEND_ENV_VAR,
            ATTENTION_BACKENDS,
        )

    def describe_settings(self) -> str:
        """The settings that the environment may give, as resolved (start-up log)."""
        partition = self.pp_layer_partition or "even split"
        return (
            f"pp layer partition {partition}, KDA backend {self.kda_backend}, "
            f"attention backend {self.attention_backend}, "
            f"kv cache dtype {self.kv_cache_dtype}, "
            f"async scheduling {'on' if self.async_scheduling else 'off'}, "
            f"{self.quantization.describe()}"
        )

    @property
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size)

    @property
    def node_layout(self) -> NodeLayout:
        return NodeLayout(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
            dist_interface=self.dist_interface,
            join_timeout=self.join_timeout,
            node_timeout=self.node_timeout,
            store_hosted_elsewhere=self.store_hosted_elsewhere,
        )

    def _build_limits(self) -> EngineLimits:
        return EngineLimits(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_speculative_tokens=self.num_speculative_tokens,
            # One per request slot: a recurrent layer resumes a cached prefix only
            # from a saved state (models without one never use them).
            num_state_checkpoints=(
                self.max_num_seqs if self.enable_prefix_caching else 0
            ),
            enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            async_scheduling=self.async_scheduling,
        )

    def _validate_parallel(self, text: HFConfig) -> None:
        pp, tp = self.pipeline_parallel_size, self.tensor_parallel_size
        layers = int(text.get("num_hidden_layers", 0))
        if pp > layers:
            raise ValueError(
                f"pipeline_parallel_size={pp} exceeds num_hidden_layers={layers}; "
                f"allowed: 1..{layers}"
            )
        for name in ("num_attention_heads", "vocab_size"):
            value = text.get(name)
            if value is not None and value % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} does not divide {name}={value}"
                )
        if self.pp_layer_partition is not None:
            validate_partition(self.pp_layer_partition, layers, pp)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        name = self.dtype
        if name == "auto":
            name = (
                self.hf_config.text.first_of(DTYPE_FIELDS)
                or self.hf_config.first_of(DTYPE_FIELDS)
                or "bfloat16"
            )
        return getattr(torch, name if name in DTYPES else "bfloat16")

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _backend_setting(
    name: str, value: str | None, env_var: str, allowed: tuple[str, ...]
) -> str:
    """A backend choice as given, else from `env_var`, else auto; checked."""
    chosen = (value or os.environ.get(env_var) or "auto").lower()
    if chosen not in allowed:
        raise ValueError(
            f"{name} ({env_var}) {chosen!r}; allowed: {', '.join(allowed)}"
        )
    return chosen


def is_context_only_producer(config: Config) -> bool:
    """A P/D prefill node: it writes KV (target and draft context) but never decodes."""
    return config.kv_role == "kv_producer"


def validate_partition(parts: list[int], num_layers: int, pp_size: int) -> None:
    if len(parts) != pp_size:
        raise ValueError(
            f"pp layer partition {parts} has {len(parts)} entries, "
            f"pipeline_parallel_size is {pp_size}"
        )
    if sum(parts) != num_layers:
        raise ValueError(
            f"pp layer partition {parts} sums to {sum(parts)}, "
            f"the model has {num_layers} layers"
        )
    if min(parts) < 1:
        raise ValueError(f"pp layer partition {parts} leaves a stage without layers")


def parse_partition(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"pp layer partition must be a comma list of integers, got {text!r}"
        ) from None
