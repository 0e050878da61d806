"""The `atom` console script: `atom serve` and `atom generate`."""

import argparse
import time
from collections.abc import Sequence

from atom.entrypoints.openai.api_server import add_server_args, run_server
from atom.entrypoints.openai_server import raise_open_file_limit
from atom.model_engine.arg_utils import EngineArgs
from atom.utils.arg_parser import FlexibleArgumentParser

# The built-in tiny models speak the English of their corpus, the King James Bible
# (docs/tiny_models.md), so the defaults open verses they can continue.
DEFAULT_PROMPTS = [
    "And God said unto Noah,",
    "The LORD is my shepherd;",
    "And Jesus answered and said unto them,",
]


def read_prompts(args: argparse.Namespace) -> list[str] | list[list[int]]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as file:
            prompts += [line.rstrip("\n") for line in file if line.strip()]
    if args.skip_tokenizer_init:
        if not prompts:
            raise SystemExit(
                "--skip-tokenizer-init: give token-id prompts, e.g. --prompt '5 77 301'"
            )
        return [token_ids(prompt) for prompt in prompts]
    return prompts or list(DEFAULT_PROMPTS)


def token_ids(prompt: str) -> list[int]:
    """'5 77 301' or '5,77,301' -> [5, 77, 301] (prompts without a tokenizer)."""
    parts = prompt.replace(",", " ").split()
    if not parts or not all(part.isdigit() for part in parts):
        raise SystemExit(
            "--skip-tokenizer-init takes token-id prompts such as '5 77 301', "
            f"got {prompt!r}"
        )
    return [int(part) for part in parts]


def run_generate(args: argparse.Namespace) -> None:
    from atom.sampling_params import SamplingParams

    prompts = read_prompts(args)
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
    except (ValueError, TypeError) as error:
        raise SystemExit(f"atom generate: {error}") from None
    engine = EngineArgs.from_cli_args(args).create_engine()
    try:
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        for prompt, result in zip(prompts, results, strict=True):
            print(f"Prompt: {prompt!r}")
            if args.skip_tokenizer_init:
                print(f"Completion: {result['token_ids']}")
            else:
                print(f"Completion: {result['text']!r}")
        mtp_line = engine.format_mtp_stats_line()
        if mtp_line:
            print(mtp_line)
        num_tokens = sum(len(result["token_ids"]) for result in results)
        print(
            f"Generated {num_tokens} tokens for {len(prompts)} prompts in "
            f"{elapsed:.2f} s ({num_tokens / elapsed:.1f} tok/s)"
        )
    finally:
        engine.close()


def run_serve(args: argparse.Namespace) -> None:
    raise_open_file_limit()
    run_server(args)


def add_generate_args(parser: FlexibleArgumentParser) -> FlexibleArgumentParser:
    parser.add_argument(
        "--prompt",
        action="append",
        help="a prompt; repeat for several (None: three built-in prompts)",
    )
    parser.add_argument(
        "--prompts-file", help="a file of prompts, one per non-empty line"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="tokens to generate per prompt"
    )
    parser.add_argument(
        "--top-k", type=int, default=-1, help="sample from the k likeliest; -1 = off"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the smallest set of this probability mass",
    )
    # --seed is an engine flag and also seeds these requests.
    return EngineArgs.add_cli_args(parser)


def make_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(prog="atom", description="atom LLM engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_server_args(serve).set_defaults(handler=run_serve)
    generate = commands.add_parser(
        "generate", help="run prompts offline and print the completions"
    )
    add_generate_args(generate).set_defaults(handler=run_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    args.handler(args)


if __name__ == "__main__":
    main()
