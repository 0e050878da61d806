"""The GPU accuracy catalog (.github/accuracy/catalog.json): read, check, expand.

An entry keeps ROCm/ATOM's fields (`model_name`, `model_path`, `extraArgs`,
`env_vars`, `runner`, `test_level`, `accuracy_threshold`, `accuracy_baseline`,
`accuracy_baseline_model`, `_baseline_note`, optional `client_command`) and adds
`platform`, `gpus`, `acceptance_min` (a fraction, or null for no acceptance gate)
and `log_markers` (start-up marker counts the gate expects). A P/D entry has a `pd`
object instead of `log_markers`: a producer and a consumer, each with its own
`extraArgs`, `gpus`, `kv_transfer_config` and `log_markers`, served beside each
other on one runner behind atom's router. docs/accuracy.md describes them.

Commands (run from the repository root):
  python -m scripts.ci.catalog check
  python -m scripts.ci.catalog matrix --level pr
  python -m scripts.ci.catalog serve-args "Kimi-K3 DSpark PP2" --models-dir /models
  python -m scripts.ci.catalog serve-args "MiniMax-M3 DSpark PP4 P/D" --side producer
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

LEVELS = ("pr", "main", "nightly", "manual")
# A pull request runs `pr` entries, a push to main adds `main`, the nightly
# schedule (and a dispatch) runs everything but `manual` entries: those need more
# GPUs than the scheduled runners have, so only a dispatch that names them runs them.
LEVELS_RUN = {
    "pr": {"pr"},
    "main": {"pr", "main"},
    "nightly": {"pr", "main", "nightly"},
}
PLATFORMS = ("rocm", "cuda")
MARKERS = ("relay", "kda_rollback")
# The P/D sides and the kv_role each one's kv_transfer_config must state.
PD_ROLES = {"producer": "kv_producer", "consumer": "kv_consumer"}
# Each server of a P/D entry sees only its own GPUs of the runner: the producer
# the first `gpus`, the consumer the next (atom numbers a server's ranks from 0).
VISIBLE_DEVICES = {"rocm": "HIP_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}
RUNNER_GPUS = re.compile(r"^gpu-(\d+)$")

# ROCm/ATOM's accuracy command (.github/scripts/atom_test.sh): full GSM8K, 3-shot.
DEFAULT_CLIENT_COMMAND = (
    "lm_eval --model local-completions --model_args "
    '"model=${MODEL_PATH},base_url=${BASE_URL}/v1/completions,num_concurrent=65,'
    'max_retries=3,tokenized_requests=False,trust_remote_code=True" '
    "--tasks gsm8k --num_fewshot 3 --output_path ${OUTPUT_PATH}"
)
# Flags whose value names a checkpoint: a Hugging Face id there means the copy
# under the models folder (atom loads folders only). Spelled as `_flag_name`
# writes them: atom takes `--a_b` for `--a-b`.
CHECKPOINT_FLAGS = ("--model", "--draft-model", "--tokenizer")
# Flags that serve.sh sets (the model and port), and those a P/D side's
# kv_transfer_config sets.
SERVE_SH_FLAGS = ("--model", "--server-port", "--port")
PD_FLAGS = ("--kv-transfer-config", "--kv-role")
TP_FLAGS = ("-tp", "--tensor-parallel-size")
HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")

FieldTypes = dict[str, type | tuple[type, ...]]
REQUIRED_FIELDS: FieldTypes = {
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
}
# Exactly one of `log_markers` and `pd` (which has them per side).
OPTIONAL_FIELDS: FieldTypes = {"client_command": str, "log_markers": dict, "pd": dict}
PD_SIDE_FIELDS: FieldTypes = {
    "extraArgs": str,
    "gpus": int,
    "kv_transfer_config": dict,
    "log_markers": dict,
}


class CatalogError(ValueError):
    pass


def local_path(value: str, models_dir: str) -> str:
    """A Hugging Face id -> its folder under `models_dir`; anything else as is."""
    return f"{models_dir.rstrip('/')}/{value}" if HF_ID.match(value) else value


def _flag_name(arg: str) -> str:
    """`--draft_model=x` -> `--draft-model`, as atom's argument parser reads it."""
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def _tensor_parallel_size(args: list[str]) -> int:
    size = "1"
    for i, arg in enumerate(args):
        if _flag_name(arg) in TP_FLAGS:
            size = arg.split("=", 1)[1] if "=" in arg else "".join(args[i + 1 : i + 2])
    if not size.isdigit():
        raise ValueError(f"tensor parallel size {size!r} is not a number")
    return int(size)


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
    def pd(self) -> dict[str, Any] | None:
        return self.fields.get("pd")

    def sides(self) -> list[str | None]:
        """The servers the entry starts: None for one aggregated server, else the
        P/D sides, producer first."""
        return list(PD_ROLES) if self.pd else [None]

    @property
    def log_markers(self) -> dict[str, int]:
        """Marker counts of the log that serves the client's completions: the
        server's, or for P/D the consumer's (the router sends decode there)."""
        if self.pd:
            return dict(self.pd["consumer"]["log_markers"])
        return dict(self.fields["log_markers"])

    @property
    def producer_log_markers(self) -> dict[str, int] | None:
        return dict(self.pd["producer"]["log_markers"]) if self.pd else None

    def _side(self, side: str | None) -> dict[str, Any] | None:
        if self.pd is None:
            if side is not None:
                raise CatalogError(f"{self.name} is not a P/D entry: no {side} side")
            return None
        if side not in PD_ROLES:
            raise CatalogError(
                f"{self.name} is a P/D entry: name its side, {' or '.join(PD_ROLES)}"
            )
        return self.pd[side]

    def extra_args(self, side: str | None = None) -> list[str]:
        """One server's flags: extraArgs, then for a P/D side its own extraArgs and
        its kv_transfer_config as --kv-transfer-config."""
        args = shlex.split(self.fields["extraArgs"])
        spec = self._side(side)
        if spec is not None:
            config = json.dumps(spec["kv_transfer_config"], separators=(",", ":"))
            args += [*shlex.split(spec["extraArgs"]), "--kv-transfer-config", config]
        return args

    def devices(self, side: str) -> list[int]:
        """The runner's GPU indices a P/D side gets: producer first."""
        spec = self._side(side)
        first = 0 if side == "producer" else self.pd["producer"]["gpus"]
        return list(range(first, first + spec["gpus"]))

    def env(self, side: str | None = None) -> dict[str, str]:
        """`env_vars` (one NAME=VALUE a line, ATOM's format), plus for a P/D side
        the platform's visible-devices variable naming its GPUs (`devices`)."""
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
        if side is not None:
            variable = VISIBLE_DEVICES[self.fields["platform"]]
            env[variable] = ",".join(str(d) for d in self.devices(side))
        return env

    def checkpoints(self) -> list[str]:
        """Hugging Face ids of the target and every checkpoint flag's value."""
        ids = [self.fields["model_path"]]
        for side in self.sides():
            args = self.extra_args(side)
            for flag, value in zip(args, args[1:]):
                if (
                    _flag_name(flag) in CHECKPOINT_FLAGS
                    and HF_ID.match(value)
                    and value not in ids
                ):
                    ids.append(value)
        return ids

    def model_path(self, models_dir: str) -> str:
        """The target's folder: what --model gets and the server serves under."""
        return local_path(self.fields["model_path"], models_dir)

    def serve_args(self, models_dir: str, side: str | None = None) -> list[str]:
        """`atom serve` arguments: --model first, Hugging Face ids made folders."""
        args = self.extra_args(side)
        for i in range(1, len(args)):
            if _flag_name(args[i - 1]) in CHECKPOINT_FLAGS:
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
            "pd": self.pd is not None,
        }


def _check_fields(
    raw: dict[str, Any],
    where: str,
    required: FieldTypes,
    optional: FieldTypes | None = None,
) -> None:
    optional = optional or {}
    unknown = sorted(set(raw) - set(required) - set(optional))
    if unknown:
        raise CatalogError(f"{where}: unknown fields {unknown}")
    for name in required:
        if name not in raw:
            raise CatalogError(f"{where}: missing field {name!r}")
    for name, kind in {**required, **optional}.items():
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


def _check_markers(markers: dict[str, Any], where: str) -> None:
    if set(markers) != set(MARKERS) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0
        for n in markers.values()
    ):
        raise CatalogError(
            f"{where}: log_markers must give a count >= 0 for each of {MARKERS}"
        )


def _check_flags(raw: dict[str, Any], where: str) -> None:
    """Every extraArgs splits, and none sets what serve.sh or a pd block sets."""
    texts = {"extraArgs": raw["extraArgs"]}
    for side in PD_ROLES if "pd" in raw else ():
        texts[f"pd.{side}.extraArgs"] = raw["pd"][side]["extraArgs"]
    for field, text in texts.items():
        try:
            names = {_flag_name(arg) for arg in shlex.split(text)}
        except ValueError as error:
            raise CatalogError(f"{where}: {field}: {error}") from None
        if names & set(SERVE_SH_FLAGS):
            raise CatalogError(
                f"{where}: {field} must not set --model (model_path does) or the "
                "port (serve.sh does)"
            )
        if names & set(PD_FLAGS):
            owner = (
                "each pd side's kv_transfer_config does"
                if "pd" in raw
                else "a P/D entry gives them per side in a pd block"
            )
            raise CatalogError(
                f"{where}: {field} must not set --kv-transfer-config or --kv-role "
                f"({owner})"
            )


def _check_pd(raw: dict[str, Any], where: str) -> None:
    pd = raw["pd"]
    if set(pd) != set(PD_ROLES):
        raise CatalogError(
            f"{where}: pd must have exactly {sorted(PD_ROLES)}, got {sorted(pd)}"
        )
    for side, role in PD_ROLES.items():
        at = f"{where} pd.{side}"
        if not isinstance(pd[side], dict):
            raise CatalogError(f"{at} must be an object")
        _check_fields(pd[side], at, PD_SIDE_FIELDS)
        if pd[side]["gpus"] < 1:
            raise CatalogError(f"{at}: gpus must be >= 1")
        _check_markers(pd[side]["log_markers"], at)
        kv_role = pd[side]["kv_transfer_config"].get("kv_role")
        if kv_role != role:
            raise CatalogError(
                f"{at}: kv_transfer_config kv_role must be {role!r}, got {kv_role!r}"
            )
    producer, consumer = pd["producer"]["gpus"], pd["consumer"]["gpus"]
    if raw["gpus"] != producer + consumer:
        raise CatalogError(
            f"{where}: gpus must be the producer's and the consumer's together "
            f"({producer} + {consumer} = {producer + consumer}), got {raw['gpus']}"
        )
    common = shlex.split(raw["extraArgs"])
    try:
        tp = {
            side: _tensor_parallel_size(common + shlex.split(pd[side]["extraArgs"]))
            for side in PD_ROLES
        }
    except ValueError as error:
        raise CatalogError(f"{where}: {error}") from None
    if tp["producer"] != tp["consumer"]:
        raise CatalogError(
            f"{where}: the producer's tensor parallel size {tp['producer']} differs "
            f"from the consumer's {tp['consumer']}; atom moves KV between equal "
            "sizes only (docs/pd.md, Limits)"
        )


def check_entry(raw: dict[str, Any], index: int) -> Entry:
    where = f"entry {index} ({raw.get('model_name', '?')})"
    _check_fields(raw, where, REQUIRED_FIELDS, OPTIONAL_FIELDS)
    if ("pd" in raw) == ("log_markers" in raw):
        raise CatalogError(
            f"{where}: give log_markers, or for P/D a pd block with log_markers "
            "per side (not both)"
        )
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
    for label in raw["runner"]:
        found = RUNNER_GPUS.match(str(label))
        if found and int(found[1]) < raw["gpus"]:
            raise CatalogError(
                f"{where}: runner label {label!r} offers fewer GPUs than the "
                f"entry's {raw['gpus']}"
            )
    for field in ("accuracy_threshold", "accuracy_baseline", "acceptance_min"):
        _fraction(raw[field], field, where)
    if "pd" in raw:
        _check_pd(raw, where)
    else:
        _check_markers(raw["log_markers"], where)
    _check_flags(raw, where)
    try:
        env = entry.env()
    except ValueError as error:
        raise CatalogError(f"{where}: {error}") from None
    variable = VISIBLE_DEVICES[raw["platform"]]
    if "pd" in raw and variable in env:
        raise CatalogError(
            f"{where}: env_vars must not set {variable}: the producer gets the "
            "runner's first GPUs, the consumer the next"
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
        raise CatalogError(f"level must be one of {tuple(LEVELS_RUN)}, got {level!r}")
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
    rows.add_argument("--level", default="pr", choices=tuple(LEVELS_RUN))
    rows.add_argument(
        "--only", default="", help="comma-separated names; overrides --level"
    )
    serve = commands.add_parser("serve-args", help="NUL-separated atom serve args")
    serve.add_argument("name")
    serve.add_argument("--models-dir", default="/models")
    serve.add_argument("--side", choices=tuple(PD_ROLES), help="a P/D entry's server")
    path = commands.add_parser("model-path", help="the target's folder")
    path.add_argument("name")
    path.add_argument("--models-dir", default="/models")
    slug = commands.add_parser("slug", help="the name as a folder name")
    slug.add_argument("name")
    env = commands.add_parser("env", help="NUL-separated NAME=VALUE of env_vars")
    env.add_argument("name")
    env.add_argument("--side", choices=tuple(PD_ROLES), help="a P/D entry's server")
    sides = commands.add_parser(
        "sides", help="a P/D entry's sides, one a line; nothing for one server"
    )
    sides.add_argument("name")
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
            _print_nul_separated(entry.serve_args(args.models_dir, args.side))
        elif args.command == "model-path":
            print(find_entry(entries, args.name).model_path(args.models_dir))
        elif args.command == "slug":
            print(find_entry(entries, args.name).slug)
        elif args.command == "env":
            entry = find_entry(entries, args.name)
            env = entry.env(args.side)
            _print_nul_separated([f"{k}={v}" for k, v in env.items()])
        elif args.command == "sides":
            entry = find_entry(entries, args.name)
            print("\n".join(side for side in entry.sides() if side))
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
