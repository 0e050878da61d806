"""Argument parser that accepts every long flag in kebab- or snake-case.

Recipes mix `--max-model-len` and `--max_model_len`; both must reach the same
option. Boolean `store_true` flags also get a `--no-<flag>` form, and flags that
atom deliberately does not implement can be registered so that using them fails
loudly instead of being silently ignored.
"""

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, with a clear message for anything else."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0, with a clear message for anything else."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def _kebab(option: str) -> str:
    return option.replace("_", "-")


class _NegatableStoreTrue(argparse.BooleanOptionalAction):
    """`store_true` that also registers `--no-<flag>`."""

    def __init__(self, option_strings, dest, default=False, **kwargs):
        super().__init__(option_strings, dest, default=default, **kwargs)


class _UnsupportedFlag(argparse.Action):
    """Consumes an optional value, then fails the parse with a clear message."""

    def __init__(self, option_strings, dest, hint: str = "", **kwargs):
        super().__init__(
            option_strings,
            dest,
            nargs="?",
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        suffix = f" ({self.hint})" if self.hint else ""
        parser.error(f"{option_string} is not supported by atom{suffix}")


class FlexibleArgumentParser(argparse.ArgumentParser):
    """ArgumentParser where `--a-b`, `--a_b` and `--a-b=v`, `--a_b=v` are one flag."""

    def __init__(self, *args, **kwargs):
        # Prefix matching would let `--port` silently hit some `--port-…` flag.
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        # The action registry is shared with argument groups, so this reaches
        # flags added through groups as well.
        self.register("action", "store_true", _NegatableStoreTrue)

    def error(self, message: str) -> NoReturn:
        """One line instead of argparse's usage block, which for the engine's
        dozens of flags buries the mistake; --help still lists them."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_unsupported_argument(self, *names: str, hint: str = "") -> None:
        """Register flags that exist in ROCm/ATOM but are rejected by atom."""
        self.add_argument(*names, action=_UnsupportedFlag, hint=hint)

    def parse_known_args(
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ):
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._canonical_argv(argv), namespace)

    def _canonical_argv(self, argv: list[str]) -> list[str]:
        """Rewrite each long flag to the spelling it was registered with."""
        registered = {
            _kebab(option): option
            for option in self._option_string_actions
            if option.startswith("--")
        }
        canonical = []
        for position, token in enumerate(argv):
            if token == "--":
                return canonical + argv[position:]
            if token.startswith("--"):
                name, sep, value = token.partition("=")
                if name not in self._option_string_actions:
                    name = registered.get(_kebab(name), name)
                token = name + sep + value
            canonical.append(token)
        return canonical
