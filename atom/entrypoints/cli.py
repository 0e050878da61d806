"""The `atom` console script: `atom serve` and `atom generate`.

Building the parser imports neither torch nor the engine, so `atom --help` and
`atom --version` answer at once; a command imports the engine when it runs.
Ordinary mistakes end in one `atom <command>: error: ...` line and status 1; an
unexpected exception keeps its traceback, since it is a bug to report.
"""

import argparse
import signal
import time
from collections.abc import Sequence
from importlib import metadata
from typing import NoReturn

from atom.entrypoints.openai.api_server import add_server_args, run_server
from atom.entrypoints.openai_server import raise_open_file_limit
from atom.model_engine.arg_utils import EngineArgs
from atom.utils.arg_parser import FlexibleArgumentParser
from atom.utils.clean_exit import exit_cleanly_on

# The built-in tiny models speak the English of their corpus, the King James Bible
# (docs/tiny_models.md), so the defaults open verses they can continue.
DEFAULT_PROMPTS = [
    "And God said unto Noah,",
    "The LORD is my shepherd;",
    "And Jesus answered and said unto them,",
]


def refuse(command: str, error: Exception | str) -> NoReturn:
    """End `atom <command>` on a user mistake: one line on stderr, status 1."""
    raise SystemExit(f"atom {command}: error: {error}")


def read_prompts(args: argparse.Namespace) -> list[str] | list[list[int]]:
    prompts = list(args.prompt or [])
    if any(not prompt for prompt in prompts):
        refuse("generate", "--prompt is empty: give the text to continue")
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as file:
                prompts += [line.rstrip("\n") for line in file if line.strip()]
        except (OSError, UnicodeDecodeError) as error:
            refuse("generate", f"--prompts-file: {error}")
    if args.skip_tokenizer_init:
        if not prompts:
            refuse(
                "generate",
                "--skip-tokenizer-init: give token-id prompts, e.g. --prompt '5 77 301'",
            )
        return [token_ids(prompt) for prompt in prompts]
    return prompts or list(DEFAULT_PROMPTS)


def token_ids(prompt: str) -> list[int]:
    """'5 77 301' or '5,77,301' -> [5, 77, 301] (prompts without a tokenizer)."""
    parts = prompt.replace(",", " ").split()
    if not parts or not all(part.isdigit() for part in parts):
        refuse(
            "generate",
            "--skip-tokenizer-init takes token-id prompts such as '5 77 301', "
            f"got {prompt!r}",
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
        refuse("generate", error)
    try:
        engine = EngineArgs.from_cli_args(args).create_engine()
    except (ValueError, TypeError) as error:  # settings refused before any step
        refuse("generate", error)
    try:
        start = time.perf_counter()
        try:
            results = engine.generate(prompts, params)
        except ValueError as error:  # a request refused, e.g. too long to fit
            refuse("generate", error)
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
    try:
        run_server(args)
    except ValueError as error:
        # What reaches here is the engine refusing its settings as it starts: a
        # request's ValueError is its own 400, and a dead engine exits on its own.
        refuse("serve", error)


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


def package_version() -> str:
    try:
        return metadata.version("atom")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


def make_parser() -> FlexibleArgumentParser:
    parser = FlexibleArgumentParser(prog="atom", description="atom LLM engine")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {package_version()}"
    )
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
    # Ctrl-C ends a command as SIGTERM does: status 0, through the `finally`
    # blocks that close the engine and its ranks. uvicorn handles both signals
    # while it serves and re-raises them once it has shut down.
    with exit_cleanly_on(signal.SIGINT, signal.SIGTERM):
        args.handler(args)


if __name__ == "__main__":
    main()
