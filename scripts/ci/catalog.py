"""The GPU accuracy catalog (.github/accuracy/catalog.json): read, check, expand.

An entry keeps ROCm/ATOM's fields (`model_name`, `model_path`, `extraArgs`,
`env_vars`, `runner`, `test_level`, `accuracy_threshold`, `accuracy_baseline`,
`accuracy_baseline_model`, `_baseline_note`, optional `client_command`) and adds
`platform`, `gpus`, `acceptance_min` (a fraction, or null for no acceptance gate)
and `log_markers` (start-up marker counts the gate expects). docs/accuracy.md
describes them.

Commands (run from the repository root):
  python -m scripts.ci.catalog check
  python -m scripts.ci.catalog matrix --level pr
  python -m scripts.ci.catalog serve-args "Kimi-K3 DSpark PP2" --models-dir /models
  python -m scripts.ci.catalog client-command NAME --model-path P --base-url U \
      --output-path O
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CATALOG = REPO_ROOT / ".github" / "accuracy" / "catalog.json"

LEVELS = ("pr", "main", "nightly")
# A pull request runs `pr` entries, a push to main adds `main`, the nightly
# schedule (and a dispatch) runs everything.
LEVELS_RUN = {"pr": {"pr"}, "main": {"pr", "main"}, "nightly": set(LEVELS)}
PLATFORMS = ("rocm", "cuda")
MARKERS = ("relay", "kda_rollback")

# ROCm/ATOM's accuracy command (.github/scripts/atom_test.sh): full GSM8K, 3-shot.
DEFAULT_CLIENT_COMMAND = (
    "lm_eval --model local-completions --model_args "
    '"model=${MODEL_PATH},base_url=${BASE_URL}/v1/completions,num_concurrent=65,'
    'max_retries=3,tokenized_requests=False,trust_remote_code=True" '
    "--tasks gsm8k --num_fewshot 3 --output_path ${OUTPUT_PATH}"
)
# Flags whose value names a checkpoint: a Hugging Face id there means the copy
# under the models folder (atom loads folders only).
CHECKPOINT_FLAGS = ("--model", "--draft-model", "--draft_model", "--tokenizer")
HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")

REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "model_name": str,
    "model_path": str,
    "extraArgs": str,
    "env_vars": str,
    "runner": list,
    "platform": str,
    "gpus": int,
    "test_level": str,
    "accuracy_threshold": float,
    "accuracy_baseline": float,
    "accuracy_baseline_model": str,
    "_baseline_note": str,
    "acceptance_min": (float, type(None)),
    "log_markers": dict,
}
OPTIONAL_FIELDS: dict[str, type | tuple[type, ...]] = {"client_command": str}


class CatalogError(ValueError):
    pass


def local_path(value: str, models_dir: str) -> str:
    """A Hugging Face id -> its folder under `models_dir`; anything else as is."""
    return f"{models_dir.rstrip('/')}/{value}" if HF_ID.match(value) else value


@dataclass(frozen=True)
class Entry:
    """One catalog entry, checked."""

    fields: dict[str, Any]

    @property
    def name(self) -> str:
        return self.fields["model_name"]

    @property
    def slug(self) -> str:
        """A file-name-safe form of the name (artifact and folder names)."""
        return re.sub(r"[^A-Za-z0-9.]+", "-", self.name).strip("-")

    @property
    def acceptance_min(self) -> float | None:
        return self.fields["acceptance_min"]

    @property
    def log_markers(self) -> dict[str, int]:
        return dict(self.fields["log_markers"])

    def extra_args(self) -> list[str]:
        return shlex.split(self.fields["extraArgs"])

    def env(self) -> dict[str, str]:
        """`env_vars`: one NAME=VALUE a line (ATOM's format)."""
        env = {}
        for line in self.fields["env_vars"].splitlines():
            if not line.strip():
                continue
            name, sep, value = line.strip().partition("=")
            if not sep or not name.isidentifier():
                raise CatalogError(
                    f"{self.name}: env_vars line {line!r} is not NAME=VALUE"
                )
            env[name] = value
        return env

    def checkpoints(self) -> list[str]:
        """Hugging Face ids of the target and every checkpoint flag's value."""
        ids = [self.fields["model_path"]]
        args = self.extra_args()
        for flag, value in zip(args, args[1:]):
            if flag in CHECKPOINT_FLAGS and HF_ID.match(value) and value not in ids:
                ids.append(value)
        return ids

    def model_path(self, models_dir: str) -> str:
        """The target's folder: what --model gets and the server serves under."""
        return local_path(self.fields["model_path"], models_dir)

    def serve_args(self, models_dir: str) -> list[str]:
        """`atom serve` arguments: --model first, Hugging Face ids made folders."""
        args = self.extra_args()
        for i in range(1, len(args)):
            if args[i - 1] in CHECKPOINT_FLAGS:
                args[i] = local_path(args[i], models_dir)
        return ["--model", self.model_path(models_dir), *args]

    def client_command(self, values: dict[str, str]) -> list[str]:
        """The lm-eval command with ${MODEL_PATH}, ${BASE_URL} and ${OUTPUT_PATH}
        filled in; an unknown placeholder is an error (ATOM exits 2 on it)."""
        template = self.fields.get("client_command", DEFAULT_CLIENT_COMMAND)
        unknown = sorted(set(PLACEHOLDER.findall(template)) - set(values))
        if unknown:
            raise CatalogError(
                f"{self.name}: client_command has unresolved placeholders "
                f"{', '.join('${' + u + '}' for u in unknown)}"
            )
        filled = PLACEHOLDER.sub(lambda m: values[m[1]], template)
        return shlex.split(filled)

    def matrix_row(self) -> dict[str, Any]:
        return {
            "model_name": self.name,
            "slug": self.slug,
            "platform": self.fields["platform"],
            "runner": self.fields["runner"],
            "gpus": self.fields["gpus"],
        }


def _check_fields(raw: dict[str, Any], where: str) -> None:
    known = set(REQUIRED_FIELDS) | set(OPTIONAL_FIELDS)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CatalogError(f"{where}: unknown fields {unknown}")
    for name in REQUIRED_FIELDS:
        if name not in raw:
            raise CatalogError(f"{where}: missing field {name!r}")
    for name, kind in {**REQUIRED_FIELDS, **OPTIONAL_FIELDS}.items():
        if name not in raw:
            continue
        value = raw[name]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # JSON has one number type: 1 is as good a threshold as 1.0.
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            continue
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise CatalogError(
                f"{where}: field {name!r} has type {type(value).__name__}"
            )


def _fraction(value: float | None, what: str, where: str) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise CatalogError(
            f"{where}: {what} must be a fraction in [0, 1], got {value} "
            "(percentages belong in logs, not in the catalog)"
        )


def check_entry(raw: dict[str, Any], index: int) -> Entry:
    where = f"entry {index} ({raw.get('model_name', '?')})"
    _check_fields(raw, where)
    entry = Entry(raw)
    if raw["test_level"] not in LEVELS:
        raise CatalogError(f"{where}: test_level must be one of {LEVELS}")
    if raw["platform"] not in PLATFORMS:
        raise CatalogError(f"{where}: platform must be one of {PLATFORMS}")
    if raw["platform"] not in raw["runner"] or "self-hosted" not in raw["runner"]:
        raise CatalogError(
            f"{where}: runner labels {raw['runner']} must include 'self-hosted' "
            f"and the platform {raw['platform']!r}"
        )
    if raw["gpus"] < 1:
        raise CatalogError(f"{where}: gpus must be >= 1")
    for field in ("accuracy_threshold", "accuracy_baseline", "acceptance_min"):
        _fraction(raw[field], field, where)
    markers = raw["log_markers"]
    if set(markers) != set(MARKERS) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0
        for n in markers.values()
    ):
        raise CatalogError(
            f"{where}: log_markers must give a count >= 0 for each of {MARKERS}"
        )
    try:
        entry.extra_args()
        entry.env()
    except ValueError as error:
        raise CatalogError(f"{where}: {error}") from None
    if any(
        flag in ("--model", "--server-port", "--port") for flag in entry.extra_args()
    ):
        raise CatalogError(
            f"{where}: extraArgs must not set --model (model_path does) or the port "
            "(serve.sh does)"
        )
    return entry


def load_catalog(path: str | Path = DEFAULT_CATALOG) -> list[Entry]:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CatalogError(f"cannot read the catalog {path}: {error}") from None
    if not isinstance(raw, list) or not all(isinstance(e, dict) for e in raw):
        raise CatalogError(f"{path}: the catalog must be a JSON list of objects")
    entries = [check_entry(item, i) for i, item in enumerate(raw)]
    names = [e.name for e in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise CatalogError(f"{path}: duplicate model_name {duplicates}")
    slugs = [e.slug for e in entries]
    if len(set(slugs)) != len(slugs):
        raise CatalogError(f"{path}: two names reduce to the same slug")
    return entries


def find_entry(entries: list[Entry], name: str) -> Entry:
    for entry in entries:
        if entry.name == name:
            return entry
    known = ", ".join(repr(e.name) for e in entries)
    raise CatalogError(f"no catalog entry named {name!r}; entries: {known}")


def matrix(entries: list[Entry], level: str, only: list[str]) -> list[dict[str, Any]]:
    """Matrix rows of the entries a run at `level` covers (or just `only`)."""
    if level not in LEVELS_RUN:
        raise CatalogError(f"level must be one of {LEVELS}, got {level!r}")
    if only:
        return [find_entry(entries, name).matrix_row() for name in only]
    wanted = LEVELS_RUN[level]
    return [e.matrix_row() for e in entries if e.fields["test_level"] in wanted]


def _print_nul_separated(items: list[str]) -> None:
    # NUL-separated so that bash `mapfile -d ''` keeps every argument whole.
    sys.stdout.write("".join(f"{item}\0" for item in items))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--catalog", default=str(DEFAULT_CATALOG))
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("check", help="check every entry; exit 1 on a problem")
    rows = commands.add_parser("matrix", help="JSON matrix rows for a run level")
    rows.add_argument("--level", default="pr", choices=LEVELS)
    rows.add_argument(
        "--only", default="", help="comma-separated names; overrides --level"
    )
    serve = commands.add_parser("serve-args", help="NUL-separated atom serve args")
    serve.add_argument("name")
    serve.add_argument("--models-dir", default="/models")
    path = commands.add_parser("model-path", help="the target's folder")
    path.add_argument("name")
    path.add_argument("--models-dir", default="/models")
    slug = commands.add_parser("slug", help="the name as a folder name")
    slug.add_argument("name")
    env = commands.add_parser("env", help="NUL-separated NAME=VALUE of env_vars")
    env.add_argument("name")
    client = commands.add_parser("client-command", help="NUL-separated lm-eval argv")
    client.add_argument("name")
    client.add_argument("--model-path", required=True)
    client.add_argument("--base-url", required=True)
    client.add_argument("--output-path", required=True)
    models = commands.add_parser("checkpoints", help="Hugging Face ids, one a line")
    models.add_argument("name")
    args = parser.parse_args(argv)
    try:
        entries = load_catalog(args.catalog)
        if args.command == "check":
            print(f"{len(entries)} catalog entries are well formed")
        elif args.command == "matrix":
            only = [n.strip() for n in args.only.split(",") if n.strip()]
            print(json.dumps(matrix(entries, args.level, only)))
        elif args.command == "serve-args":
            entry = find_entry(entries, args.name)
            _print_nul_separated(entry.serve_args(args.models_dir))
        elif args.command == "model-path":
            print(find_entry(entries, args.name).model_path(args.models_dir))
        elif args.command == "slug":
            print(find_entry(entries, args.name).slug)
        elif args.command == "env":
            entry = find_entry(entries, args.name)
            _print_nul_separated([f"{k}={v}" for k, v in entry.env().items()])
        elif args.command == "client-command":
            values = {
                "MODEL_PATH": args.model_path,
                "BASE_URL": args.base_url.rstrip("/"),
                "OUTPUT_PATH": args.output_path,
            }
            _print_nul_separated(find_entry(entries, args.name).client_command(values))
        else:
            print("\n".join(find_entry(entries, args.name).checkpoints()))
    except CatalogError as error:
        print(f"catalog: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
