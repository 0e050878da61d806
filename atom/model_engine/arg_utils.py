"""Engine command-line flags: `EngineArgs` and its argparse wiring."""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from atom.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    KV_ROLES,
    SPECULATIVE_METHODS,
    EngineSettings,
    parse_partition,
)
from atom.model_ops.quantization.config import parse_online_scheme
from atom.sampling_params import MAX_SEED, SEED_RULE
from atom.utils.arg_parser import (
    FlexibleArgumentParser,
    non_negative_int,
    positive_int,
    positive_seconds,
)

# The tiny test checkpoints ship a matching DSpark draft, so `--method dspark`
# works on them without naming one.
TINY_DSPARK_DRAFTS = {
    "tiny-kimi-k3": "tiny-kimi-k3-dspark",
    "tiny-kimi-k31": "tiny-kimi-k31-dspark",
}

# ROCm/ATOM flags that atom does not implement, with a hint where one helps.
# Registering them turns a silent mismatch into an explicit error.
UNSUPPORTED_ENGINE_FLAGS: dict[tuple[str, ...], str] = {
    ("--port",): "it is ATOM's internal engine port; use --server-port",
    ("-dp", "--data-parallel-size"): "",
    ("--data-parallel-rank",): "",
    ("--enable-dp-attention",): "",
    ("--enable-expert-parallel",): "",
    ("--enable-eplb",): "",
    ("--num-redundant-experts",): "",
    ("--enable-tbo",): "",
    ("--prefill-context-parallel-size",): "",
    ("--decode-context-parallel-size",): "",
    ("--cudagraph-mode",): "",
    ("--level",): "",
    ("--hf-overrides",): "",
    ("--load-dummy",): "",
    ("--torch-profiler-dir",): "",
    ("--long-prefill-token-threshold",): "",
    ("--state-checkpoint-interval-tokens",): "",
    ("--spec-decode-acceptance-length",): "",
    ("--spec-decode-acceptance-rate",): "",
    ("--dspark-config",): "",
    ("--speculative-config",): "use --method/--draft-model/--num-speculative-tokens",
}


# Accepted so recipes run unchanged, but meaningless to the engine.
CLI_ONLY_FIELDS = frozenset({"trust_remote_code"})

# Flags that take a positive integer -> help; each defaults to its EngineArgs field.
POSITIVE_INT_FLAGS: dict[tuple[str, ...], str] = {
    ("-tp", "--tensor-parallel-size"): "ranks per pipeline stage",
    ("-pp", "--pipeline-parallel-size"): "pipeline stages",
    ("--block-size",): "tokens per KV cache block",
    ("--max-model-len",): "context length; None = the model config's",
    ("--max-num-batched-tokens",): "tokens per step, over all sequences",
    ("--max-num-seqs",): "sequences running at once",
    ("--num-kvcache-blocks",): "KV cache size in blocks; None = sized from free memory",
    ("--num-speculative-tokens",): "draft tokens verified per step",
}


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected {SEED_RULE}, got {text!r}")
    return value


def _layer_partition(text: str) -> list[int]:
    """'24,23' -> [24, 23]: layers per pipeline stage (sums are checked by Config)."""
    try:
        counts = parse_partition(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(
            f"every stage needs at least one layer, got {text!r}"
        )
    return counts


def _online_quant_config(text: str) -> str:
    """The JSON as given, once it names a supported scheme (Config parses it)."""
    try:
        parse_online_scheme(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _size_list(text: str) -> list[int]:
    """'[16,64]' or '16,64' -> [16, 64] (ATOM writes a list literal); '[]' -> []."""
    try:
        sizes = [int(part) for part in text.strip("[] ").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"capture sizes must be a list of integers like '[1,2,4]', got {text!r}"
        ) from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(
            f"capture sizes must be positive integers, got {text!r}"
        )
    return sizes


def parse_prefill_capture_sizes(text: str) -> tuple[int, ...]:
    """'[16,64]' or '16,64' -> (16, 64); '[]' or '' -> () (every prefill eager).
    The benchmarks' flag of the same name parses with it too."""
    return tuple(_size_list(text))


def _capture_sizes(text: str) -> list[int]:
    """'[1,2,4]' or '1,2,4' -> [1, 2, 4]; at least one size."""
    sizes = _size_list(text)
    if not sizes:
        raise argparse.ArgumentTypeError(
            f"capture sizes must name at least one size, got {text!r}"
        )
    return sizes


def add_node_args(parser: FlexibleArgumentParser, defaults: EngineSettings) -> None:
    """The flags of a world spread over several machines (docs/serving.md)."""
    nodes = parser.add_argument_group(
        "multi-node", "one world over several machines; torchrun's variables also work"
    )
    nodes.add_argument(
        "--nnodes", type=positive_int, default=defaults.nnodes, help="machines"
    )
    nodes.add_argument(
        "--node-rank",
        type=non_negative_int,
        default=defaults.node_rank,
        help="this machine's index; 0 serves, the others run with --headless",
    )
    nodes.add_argument(
        "--master-addr",
        default=defaults.master_addr,
        help="address of node 0, where it serves the rendezvous (and only there)",
    )
    nodes.add_argument(
        "--master-port",
        type=positive_int,
        default=defaults.master_port,
        help="rendezvous port on node 0; keep it on a trusted network",
    )
    nodes.add_argument(
        "--dist-interface",
        default=defaults.dist_interface,
        help="network interface for gloo / NCCL (sets GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME); None = the one that reaches --master-addr",
    )
    nodes.add_argument(
        "--join-timeout",
        type=positive_seconds,
        default=defaults.join_timeout,
        help="seconds every node may take to join; a missing one is named",
    )
    nodes.add_argument(
        "--node-timeout",
        type=positive_seconds,
        default=defaults.node_timeout,
        help="seconds without a heartbeat after which a node counts as dead",
    )


@dataclass
class EngineArgs(EngineSettings):
    """The engine's settings as flags; unset optional fields are left to `Config`."""

    seed: int | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.method == "dspark" and self.draft_model is None:
            self.draft_model = TINY_DSPARK_DRAFTS.get(self.model)

    @staticmethod
    def add_cli_args(parser: FlexibleArgumentParser) -> FlexibleArgumentParser:
        defaults = EngineArgs()
        parser.add_argument(
            "--model",
            default=defaults.model,
            help="model folder, or a built-in tiny model name",
        )
        parser.add_argument(
            "--tokenizer",
            default=None,
            help="tokenizer folder; None = the --model folder",
        )
        parser.add_argument(
            "--skip-tokenizer-init",
            action="store_true",
            help="load no tokenizer: prompts must be token ids, outputs are token ids",
        )
        for names, help_text in POSITIVE_INT_FLAGS.items():
            field_name = names[-1].removeprefix("--").replace("-", "_")
            parser.add_argument(
                *names,
                type=positive_int,
                default=getattr(defaults, field_name),
                help=help_text,
            )
        parser.add_argument(
            "--device",
            choices=["auto", "cpu", "cuda"],
            default=defaults.device,
            help="auto = cuda when available, else cpu",
        )
        parser.add_argument(
            "--dtype",
            choices=["auto", *DTYPES],
            default=defaults.dtype,
            help="weight and activation dtype; auto = the checkpoint's",
        )
        parser.add_argument(
            "--enforce-eager",
            action="store_true",
            help="never capture CUDA graphs (CPU always runs eagerly)",
        )
        parser.add_argument(
            "--cudagraph-capture-sizes",
            type=_capture_sizes,
            default=None,
            help="decode batch sizes to capture as CUDA graphs, e.g. '[1,2,4,8]' "
            "(default: 1, 2, 4, 8, 16, 24, 32, 48, ... up to --max-num-seqs)",
        )
        parser.add_argument(
            "--prefill-capture-sizes",
            type=parse_prefill_capture_sizes,
            default=defaults.prefill_capture_sizes,
            help="token counts of one-prompt prefills to capture as CUDA graphs, "
            "'[]' for none",
        )
        parser.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=defaults.enable_prefix_caching,
            help="reuse the KV cache and KDA states of shared prompt prefixes",
        )
        parser.add_argument(
            "--enable-chunked-prefill",
            action=argparse.BooleanOptionalAction,
            default=defaults.enable_chunked_prefill,
            help="split long prompts across steps",
        )
        parser.add_argument(
            "--scheduler-delay-factor",
            type=float,
            default=defaults.scheduler_delay_factor,
            help="while sequences decode, hold a new prompt back until it has "
            "waited this many times the last prefill step, so that arrivals share "
            "one prefill (0: start it at once)",
        )
        parser.add_argument(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=defaults.async_scheduling,
            help="schedule and prepare the next step while the device runs this "
            "one (tp = pp = 1, without speculation or P/D; default: on where it "
            "runs on a GPU)",
        )
        parser.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=defaults.gpu_memory_utilization,
            help="share of GPU memory the engine may fill, KV cache included",
        )
        parser.add_argument(
            "--method",
            choices=SPECULATIVE_METHODS,
            default=None,
            help="speculative decoding method",
        )
        parser.add_argument(
            "--draft-model",
            default=None,
            help="standalone draft folder; None = the tiny models' own draft",
        )
        parser.add_argument(
            "--kv-role",
            choices=KV_ROLES,
            default=defaults.kv_role,
            help="prefill/decode disaggregation role",
        )
        parser.add_argument(
            "--online-quant-config",
            type=_online_quant_config,
            default=None,
            help="online weight quantization as ATOM writes it, e.g. "
            '\'{"global_quant_config": "ptpc_fp8"}\' (fp8 weights per output '
            "channel, fp8 activations per token); None = the checkpoint's weights",
        )
        parser.add_argument(
            "--kv-cache-dtype",
            choices=KV_CACHE_DTYPES,
            default=defaults.kv_cache_dtype,
            help="paged KV cache rows: auto = the model dtype; fp8 (fp8_e4m3) = "
            "float8 e4m3 rows with a per-layer scale (KDA states stay as they are)",
        )
        parser.add_argument(
            "--kv-transfer-config",
            default=None,
            help='P/D disaggregation as JSON, e.g. \'{"kv_role": "kv_producer", '
            '"kv_connector": "mooncake"}\' (docs/pd.md)',
        )
        parser.add_argument(
            "--pp-layer-partition",
            type=_layer_partition,
            default=None,
            help="layers per pipeline stage, e.g. '24,23'; None = as even as possible",
        )
        parser.add_argument(
            "--seed",
            type=_seed,
            default=None,
            help=f"random seed; `atom generate` seeds its requests with it ({SEED_RULE})",
        )
        parser.add_argument(
            "--trust-remote-code",
            action="store_true",
            help="accepted for compatibility; atom runs no remote code",
        )
        add_node_args(parser, defaults)
        for names, hint in UNSUPPORTED_ENGINE_FLAGS.items():
            parser.add_unsupported_argument(*names, hint=hint)
        return parser

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "EngineArgs":
        names = (f.name for f in dataclasses.fields(cls))
        return cls(**{name: getattr(namespace, name) for name in names})

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `LLMEngine`; unset optional fields are left to it."""
        return {
            name: value
            for name, value in dataclasses.asdict(self).items()
            if value is not None and name not in CLI_ONLY_FIELDS
        }

    def create_engine(self):
        # Imported here so that parsing flags never pulls in torch.
        from atom.model_engine.llm_engine import LLMEngine

        return LLMEngine(**self.engine_kwargs())
