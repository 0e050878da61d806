"""atom vs transformers on one Kimi Linear checkpoint that transformers itself writes.

transformers' `KimiLinearForCausalLM` builds the checkpoint (seeded random init, saved
with `save_pretrained` plus a tokenizer); then, in this one process, transformers'
`generate` and atom's `LLMEngine` run the same token-id prompts greedily (EOS ignored)
at each batch size. Per batch size it prints tok/s of both, atom/transformers, how
many greedy continuations agree (and their mean common prefix), atom's prefill time
and decode step time, and the fraction of the HBM roofline that step reaches.

    # issue 10's shape (bf16, 2.6 B parameters) on one H200:
    python benchmarks/bench_vs_transformers.py --device cuda
    python benchmarks/bench_vs_transformers.py --device cuda \\
        --skip-transformers-at 128 --checkpoint /tmp/kimi-bench
    # small fp32 shape; every continuation must agree (exit 1 otherwise):
    python benchmarks/bench_vs_transformers.py --preset small --device cpu

The decode step time is (t(max_tokens=N) - t(max_tokens=1)) / (N - 1): the second
run is prefill plus the first token. Prefix caching is off in atom, so neither run
reuses the other's prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("USE_HUB_KERNELS", "0")

import torch  # noqa: E402
import transformers  # noqa: E402
from hbm_peak import resolve_hbm_bytes_per_s  # noqa: E402
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import KimiLinearConfig, PreTrainedTokenizerFast  # noqa: E402

from atom import LLMEngine, SamplingParams  # noqa: E402
from atom.config import KV_CACHE_DTYPES, Config  # noqa: E402
from atom.model_engine.arg_utils import parse_prefill_capture_sizes  # noqa: E402
from atom.utils.log_format import configure_logging  # noqa: E402

STARTED = time.perf_counter()


def progress(message: str) -> None:
    """A timestamped line to stderr: a run stopped by a time limit still shows how
    far each phase got and what it cost."""
    print(
        f"[{time.perf_counter() - STARTED:7.1f} s] {message}",
        file=sys.stderr,
        flush=True,
    )


DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class Preset:
    """A checkpoint shape and its default run; layer ids are 1-based."""

    hidden_size: int
    num_layers: int
    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    heads: int  # MLA heads and KDA heads alike
    head_dim: int  # KDA head dim, MLA qk_nope and v head dims
    kv_lora_rank: int
    qk_rope_head_dim: int
    experts: int
    top_k: int
    moe_intermediate_size: int
    shared_experts: int
    vocab_size: int
    dtype: str
    batch_sizes: str
    input_len: int
    output_len: int
    must_agree: bool
    intermediate_size: int | None = None  # None: transformers' default


PRESETS = {
    # Issue 10: ~2.6 B parameters; layer 0 dense (transformers' default).
    "issue10": Preset(
        hidden_size=2304,
        num_layers=8,
        kda_layers=(1, 2, 3, 5, 6, 7),
        full_attn_layers=(4, 8),
        heads=16,
        head_dim=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        experts=32,
        top_k=8,
        moe_intermediate_size=1024,
        shared_experts=1,
        vocab_size=163840,
        dtype="bfloat16",
        batch_sizes="1,32,128",
        input_len=256,
        output_len=128,
        must_agree=False,
    ),
    # fp32 on a shape a CPU runs in seconds: continuations must agree exactly.
    "small": Preset(
        hidden_size=256,
        num_layers=4,
        kda_layers=(1, 3),
        full_attn_layers=(2, 4),
        heads=4,
        head_dim=64,
        kv_lora_rank=64,
        qk_rope_head_dim=32,
        experts=8,
        top_k=2,
        moe_intermediate_size=128,
        shared_experts=1,
        vocab_size=2048,
        dtype="float32",
        batch_sizes="1,4",
        input_len=32,
        output_len=16,
        must_agree=True,
        intermediate_size=512,
    ),
}


def kimi_config(preset: Preset) -> KimiLinearConfig:
    """Keyword names every transformers 5 release of KimiLinearConfig accepts."""
    vocab = preset.vocab_size
    extra = {}
    if preset.intermediate_size is not None:
        extra["intermediate_size"] = preset.intermediate_size
    if vocab < 163840:  # the default special ids lie beyond a small vocabulary
        extra.update(bos_token_id=vocab - 3, eos_token_id=vocab - 2)
        extra["pad_token_id"] = vocab - 1
    return KimiLinearConfig(
        vocab_size=vocab,
        hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.heads,
        qk_nope_head_dim=preset.head_dim,
        v_head_dim=preset.head_dim,
        qk_rope_head_dim=preset.qk_rope_head_dim,
        kv_lora_rank=preset.kv_lora_rank,
        num_local_experts=preset.experts,
        num_experts_per_tok=preset.top_k,
        n_shared_experts=preset.shared_experts,
        moe_intermediate_size=preset.moe_intermediate_size,
        linear_attn_config={
            "num_heads": preset.heads,
            "head_dim": preset.head_dim,
            "kda_layers": list(preset.kda_layers),
            "full_attn_layers": list(preset.full_attn_layers),
        },
        **extra,
    )


def write_tokenizer(folder: Path, config: KimiLinearConfig) -> None:
    """A word-level tokenizer with one token per id (`<17>`), specials included."""
    vocab = {f"<{i}>": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=f"<{config.bos_token_id}>",
        eos_token=f"<{config.eos_token_id}>",
        pad_token=f"<{config.pad_token_id}>",
    ).save_pretrained(folder)


def kimi_linear_class(with_fla: bool) -> type:
    """transformers' KimiLinearForCausalLM, with or without fla's KDA kernels.

    transformers binds fla's kernels when its modeling module is imported and fla
    imports (atom's CUDA backend needs fla installed). Its torch path is the faster
    of the two on the H200 (128 new tokens at batch 32: 9.6 s without fla, 22.7 s
    with it, after a first call of about 110 s of Triton autotuning), so the peer
    runs without fla unless --transformers-fla asks for it.
    """
    hide = not with_fla and "fla" not in sys.modules
    if hide:
        sys.modules["fla"] = None  # `import fla` raises ImportError meanwhile
    try:
        return transformers.KimiLinearForCausalLM
    finally:
        if hide:
            del sys.modules["fla"]


def build_checkpoint(preset: Preset, folder: Path, args: argparse.Namespace) -> None:
    device = args.device
    torch.manual_seed(args.seed)
    config = kimi_config(preset)
    with torch.device(device):
        # transformers' own seeded init
        model = kimi_linear_class(args.transformers_fla)(config)
    model.to(DTYPES[preset.dtype]).save_pretrained(folder)
    write_tokenizer(folder, config)
    del model
    free_device_memory(device)
    progress(f"checkpoint written to {folder}")


def free_device_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Geometry:
    """What one decode step reads, from the saved tensors and the config."""

    other_weight_bytes: int  # every weight but the embedding and routed experts
    expert_bytes: int  # one routed expert (gate, up, down)
    num_moe_layers: int
    experts: int
    top_k: int
    num_mla_layers: int
    latent_row_bytes: int  # (kv_lora_rank + qk_rope_head_dim) per token
    num_kda_layers: int
    kda_state_bytes: int  # fp32 recurrent state + conv state, per sequence

    @classmethod
    def of(cls, folder: Path, preset: Preset) -> Geometry:
        size = torch.tensor([], dtype=DTYPES[preset.dtype]).element_size()
        other, routed = 0, defaultdict(int)
        for shard in sorted(folder.glob("*.safetensors")):
            with safe_open(str(shard), "pt") as tensors:
                for name in tensors.keys():
                    count = 1
                    for dim in tensors.get_slice(name).get_shape():
                        count *= dim
                    layer = re.search(r"layers\.(\d+)\.", name)
                    if ".experts." in name and layer:
                        routed[int(layer[1])] += count * size
                    elif "embed_tokens" not in name:
                        other += count * size
        h, d, k = preset.heads, preset.head_dim, 4  # KimiLinearConfig conv width
        return cls(
            other_weight_bytes=other,
            expert_bytes=sum(routed.values()) // max(1, len(routed) * preset.experts),
            num_moe_layers=len(routed),
            experts=preset.experts,
            top_k=preset.top_k,
            num_mla_layers=len(preset.full_attn_layers),
            latent_row_bytes=(preset.kv_lora_rank + preset.qk_rope_head_dim) * size,
            num_kda_layers=len(preset.kda_layers),
            kda_state_bytes=h * d * d * 4 + 3 * h * d * (k - 1) * size,
        )

    def experts_touched(self, batch: int) -> float:
        """Expected distinct experts per MoE layer, routing uniform and independent."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** batch)

    def bytes_per_step(self, batch: int, context: float) -> float:
        return (
            self.other_weight_bytes
            + self.num_moe_layers * self.experts_touched(batch) * self.expert_bytes
            + batch * context * self.latent_row_bytes * self.num_mla_layers
            + batch * self.num_kda_layers * self.kda_state_bytes
        )

    def formula(self) -> str:
        return (
            "bytes/step = W_other + L_moe * E_hit(B) * W_expert"
            " + B * ctx * row * L_mla + B * L_kda * S_kda, with"
            f" W_other {self.other_weight_bytes / 1e9:.3f} GB (non-embedding"
            " weights but routed experts, LM head included),"
            f" W_expert {self.expert_bytes / 1e6:.2f} MB, L_moe {self.num_moe_layers},"
            f" E_hit(B) = E*(1-(1-k/E)^B) with E={self.experts} k={self.top_k},"
            f" row {self.latent_row_bytes} B (MLA latent), L_mla {self.num_mla_layers},"
            f" S_kda {self.kda_state_bytes / 1e6:.2f} MB (fp32 state + conv state),"
            f" L_kda {self.num_kda_layers}, ctx = input_len + output_len / 2"
        )


def random_prompts(count: int, length: int, limit: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(limit) for _ in range(length)] for _ in range(count)]


def run_transformers(
    folder: Path,
    args: argparse.Namespace,
    prompts: list[list[int]],
    batch_sizes: list[int],
) -> dict[int, tuple[list[list[int]], float]]:
    """Greedy continuations and seconds per batch size (skipped sizes absent)."""
    dtype = DTYPES[args.dtype]
    model = kimi_linear_class(args.transformers_fla).from_pretrained(
        folder, dtype=dtype, attn_implementation=args.hf_attn
    )
    model = model.to(args.device).eval()
    model.generation_config.eos_token_id = None  # like atom's ignore_eos
    progress("transformers model loaded")
    pad = model.config.pad_token_id

    def generate(batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        ids = torch.tensor(batch, device=args.device)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        if out.shape[1] != ids.shape[1] + new_tokens:
            raise RuntimeError(
                f"transformers generated {out.shape[1] - ids.shape[1]} tokens, "
                f"expected {new_tokens}: EOS was not ignored"
            )
        return out[:, ids.shape[1] :].tolist()

    generate(prompts[:1], 2)  # warm-up
    results = {}
    for batch in batch_sizes:
        if batch in args.skip_transformers_at:
            continue
        synchronize(args.device)
        start = time.perf_counter()
        tokens = generate(prompts[:batch], args.output_len)
        synchronize(args.device)
        results[batch] = tokens, time.perf_counter() - start
        progress(f"transformers batch {batch}: {results[batch][1]:.2f} s")
    return results


@dataclass
class AtomRun:
    tokens: list[list[int]]
    seconds: float
    prefill_seconds: float

    def decode_step_seconds(self, output_len: int) -> float:
        return (self.seconds - self.prefill_seconds) / max(1, output_len - 1)


def atom_engine_kwargs(args: argparse.Namespace, batch_sizes: list[int]) -> dict:
    kwargs = dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(batch_sizes),
        # Graphs for the measured batch sizes only: each decode step replays the
        # graph of its exact size either way, and the start-up skips the ladder's
        # other sizes (and the kernel variants they would compile).
        cudagraph_capture_sizes=sorted(set(batch_sizes)),
        max_model_len=args.input_len + args.output_len + 16,
        enable_prefix_caching=False,  # repeated prompts must not skip prefill
        online_quant_config=args.online_quant_config,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.async_scheduling is not None:
        kwargs["async_scheduling"] = args.async_scheduling
    if args.prefill_capture_sizes is not None:
        kwargs["prefill_capture_sizes"] = args.prefill_capture_sizes
    if args.enforce_eager:
        accepted = {field.name for field in dataclasses.fields(Config)}
        if "enforce_eager" not in accepted:
            raise SystemExit("--enforce-eager: this atom has no enforce_eager")
        kwargs["enforce_eager"] = True
    return kwargs


def run_atom(
    folder: Path,
    args: argparse.Namespace,
    prompts: list[list[int]],
    batch_sizes: list[int],
) -> dict[int, AtomRun]:
    engine = LLMEngine(str(folder), **atom_engine_kwargs(args, batch_sizes))
    # The block count shows what an fp8 KV cache buys in capacity.
    progress(f"atom engine started, {engine.workers.info.num_kv_blocks} KV blocks")

    def generate(batch: list[list[int]], new_tokens: int) -> tuple[list, float]:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = engine.generate(batch, params)
        return [o["token_ids"] for o in outputs], time.perf_counter() - start

    try:
        generate(prompts[: min(2, len(prompts))], 2)  # warm-up
        results = {}
        for batch in batch_sizes:
            # Twice: the first prefill of a shape can pay for kernel autotuning.
            prefill = min(generate(prompts[:batch], 1)[1] for _ in range(2))
            tokens, seconds = generate(prompts[:batch], args.output_len)
            results[batch] = AtomRun(tokens, seconds, prefill)
            progress(f"atom batch {batch}: {seconds:.2f} s")
    finally:
        engine.close()
    return results


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def report(
    args: argparse.Namespace,
    geometry: Geometry,
    hf: dict[int, tuple[list[list[int]], float]],
    atom: dict[int, AtomRun],
) -> bool:
    """Print one block per batch size; True if every compared continuation agrees."""
    all_agree = True
    context = args.input_len + args.output_len / 2
    for batch, run in atom.items():
        generated = batch * args.output_len
        atom_rate = generated / run.seconds
        line = f"batch {batch:4d}: atom {atom_rate:9.1f} tok/s ({run.seconds:.2f} s)"
        if batch in hf:
            hf_tokens, hf_seconds = hf[batch]
            hf_rate = generated / hf_seconds
            agree = sum(a == b for a, b in zip(run.tokens, hf_tokens))
            prefix = sum(map(common_prefix, run.tokens, hf_tokens)) / batch
            all_agree &= agree == batch
            line += (
                f" | transformers {hf_rate:9.1f} tok/s ({hf_seconds:.2f} s)"
                f" | atom/transformers {atom_rate / hf_rate:6.2f}x"
                f" | greedy agree {agree}/{batch},"
                f" mean common prefix {prefix:.1f}/{args.output_len}"
            )
        else:
            line += " | transformers skipped"
        step = run.decode_step_seconds(args.output_len)
        moved = geometry.bytes_per_step(batch, context)
        print(line)
        roofline = ""
        if args.hbm_bytes_per_s:
            roofline = (
                f" = {100 * moved / step / args.hbm_bytes_per_s:.2f}% of"
                f" {args.hbm_bytes_per_s / 1e12:.2f} TB/s"
            )
        print(
            f"            atom prefill+1st token {run.prefill_seconds:.3f} s,"
            f" decode step {1e3 * step:.2f} ms ({args.output_len - 1} steps),"
            f" {moved / 1e9:.3f} GB/step -> {moved / step / 1e9:.1f} GB/s{roofline}",
            flush=True,
        )
    return all_agree


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="issue10")
    parser.add_argument("--batch-sizes", help="comma list (default: the preset's)")
    parser.add_argument("--input-len", type=int, help="prompt tokens")
    parser.add_argument("--output-len", type=int, help="greedy new tokens")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: preset's")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--skip-transformers-at",
        default="",
        help="comma list of batch sizes where transformers does not run",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="atom: no CUDA graphs"
    )
    parser.add_argument(
        "--prefill-capture-sizes",
        type=parse_prefill_capture_sizes,
        help="atom: comma list of one-prompt prefill token counts to capture as "
        "CUDA graphs; '' for none (default: the engine's)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="atom: schedule each step while the GPU runs the one before (default:"
        " the engine's, on where it runs on a GPU)",
    )
    parser.add_argument(
        "--online-quant-config",
        help='atom only, e.g. \'{"global_quant_config": "ptpc_fp8"}\' (the roofline'
        " line still counts the model dtype's weight bytes)",
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="atom only"
    )
    parser.add_argument("--hf-attn", default="sdpa", help="transformers attention")
    parser.add_argument(
        "--transformers-fla",
        action="store_true",
        help="let transformers use fla's KDA kernels (its slower path on the H200)",
    )
    parser.add_argument(
        "--checkpoint",
        help="folder for the checkpoint; reused if it holds one (default: temp)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hbm-tb-per-s",
        type=float,
        dest="hbm",
        help="the roofline's HBM bandwidth (default on CUDA: the GPU's datasheet "
        "figure, benchmarks/hbm_peak.py; on CPU no roofline is printed)",
    )
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    args.batch_sizes = [
        int(b) for b in (args.batch_sizes or preset.batch_sizes).split(",")
    ]
    args.skip_transformers_at = {
        int(b) for b in args.skip_transformers_at.split(",") if b.strip()
    }
    args.input_len = args.input_len or preset.input_len
    args.output_len = args.output_len or preset.output_len
    args.dtype = args.dtype or preset.dtype
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.hbm_bytes_per_s = (
        resolve_hbm_bytes_per_s(args.hbm) if args.device == "cuda" or args.hbm else None
    )
    if args.output_len < 2:
        parser.error("--output-len must be >= 2 to separate prefill from decode")
    return args


def main() -> None:
    args = parse_args()
    # atom's start-up lines (load, memory profile, graph capture, each timed) show
    # where the engine's start goes.
    configure_logging()
    preset = dataclasses.replace(PRESETS[args.preset], dtype=args.dtype)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"device {args.device} ({device_name}), dtype {args.dtype}, "
        f"preset {args.preset}, input {args.input_len}, output {args.output_len}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.checkpoint or Path(tmp) / "kimi-linear")
        if not (folder / "config.json").is_file():
            build_checkpoint(preset, folder, args)
        config = kimi_config(preset)
        specials = (config.bos_token_id, config.eos_token_id, config.pad_token_id)
        prompts = random_prompts(
            max(args.batch_sizes), args.input_len, min(specials), args.seed
        )
        geometry = Geometry.of(folder, preset)
        print(geometry.formula())
        hf = run_transformers(folder, args, prompts, args.batch_sizes)
        free_device_memory(args.device)  # transformers' model is gone with its run
        atom = run_atom(folder, args, prompts, args.batch_sizes)
        all_agree = report(args, geometry, hf, atom)
    # Agreement is required in fp32 only: bf16 noise flips near-tied tokens.
    if preset.must_agree and args.dtype == "float32" and not all_agree:
        print(
            f"FAIL: greedy continuations differ in the {args.preset} preset (fp32)",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
