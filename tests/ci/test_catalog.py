"""The GPU accuracy catalog: the committed entries and the checks on bad ones."""

import json
import shlex

import pytest

from atom.entrypoints.openai.api_server import add_server_args
from atom.utils.arg_parser import FlexibleArgumentParser
from scripts.ci import catalog
from scripts.ci.catalog import CatalogError, check_entry, find_entry, load_catalog

ENTRIES = load_catalog()
REQUIRED = [
    "Kimi-K3",
    "Kimi-K3 DSpark",
    "Kimi-K3 DSpark PP2",
    "Kimi-K3.1 DSpark PP2",
    "MiniMax-M3 DSpark PP2",
]


def server_args(entry):
    parser = add_server_args(FlexibleArgumentParser(prog="atom serve"))
    return parser.parse_args(entry.serve_args("/models"))


def test_the_required_entries_exist():
    names = [entry.name for entry in ENTRIES]
    assert set(REQUIRED) <= set(names)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.slug)
def test_every_entry_parses_as_atom_serve_flags_and_fills_its_gpus(entry):
    args = server_args(entry)
    assert args.model == f"/models/{entry.fields['model_path']}"
    assert (
        args.tensor_parallel_size * args.pipeline_parallel_size == entry.fields["gpus"]
    )
    if args.method == "dspark":
        assert args.draft_model.startswith("/models/")
        assert entry.log_markers["relay"] == (
            args.tensor_parallel_size if args.pipeline_parallel_size > 1 else 0
        )
    else:
        assert entry.acceptance_min is None
        assert entry.log_markers == {"relay": 0, "kda_rollback": 0}


def test_the_pp2_entry_is_the_upstream_configuration():
    entry = find_entry(ENTRIES, "Kimi-K3 DSpark PP2")
    args = server_args(entry)
    assert (args.pipeline_parallel_size, args.tensor_parallel_size) == (2, 4)
    assert args.method == "dspark" and args.num_speculative_tokens == 7
    assert args.draft_model == "/models/Inferact/Kimi-K3-DSpark"
    assert args.enable_prefix_caching
    assert entry.fields["accuracy_threshold"] == 0.94
    assert entry.acceptance_min == 0.50
    assert entry.log_markers == {"relay": 4, "kda_rollback": 8}
    assert entry.fields["test_level"] == "pr"
    assert entry.checkpoints() == ["moonshotai/Kimi-K3", "Inferact/Kimi-K3-DSpark"]


def test_the_h200_entry_runs_ptpc_fp8_as_upstream():
    args = server_args(find_entry(ENTRIES, "Kimi-K3 DSpark PP2 H200"))
    assert json.loads(args.online_quant_config) == {"global_quant_config": "ptpc_fp8"}


def test_the_k31_entry_serves_the_k31_draft():
    args = server_args(find_entry(ENTRIES, "Kimi-K3.1 DSpark PP2"))
    assert args.model.endswith("Kimi-K3.1")
    assert args.draft_model.endswith("Inferact/Kimi-K3.1-DSpark")


def test_levels_nest_and_only_picks_names():
    rows = {
        level: [row["model_name"] for row in catalog.matrix(ENTRIES, level, [])]
        for level in catalog.LEVELS
    }
    assert set(rows["pr"]) <= set(rows["main"]) <= set(rows["nightly"])
    assert rows["nightly"] == [entry.name for entry in ENTRIES]
    assert "Kimi-K3 DSpark PP2" in rows["pr"]
    only = catalog.matrix(ENTRIES, "pr", ["MiniMax-M3 DSpark PP2"])
    assert [row["slug"] for row in only] == ["MiniMax-M3-DSpark-PP2"]
    assert only[0]["runner"][:1] == ["self-hosted"]


def test_the_client_command_is_upstream_gsm8k_and_placeholders_must_resolve():
    entry = find_entry(ENTRIES, "Kimi-K3 DSpark PP2")
    values = {"MODEL_PATH": "/m", "BASE_URL": "http://h:1", "OUTPUT_PATH": "out"}
    command = entry.client_command(values)
    assert command[:3] == ["lm_eval", "--model", "local-completions"]
    assert command[command.index("--tasks") + 1] == "gsm8k"
    assert command[command.index("--num_fewshot") + 1] == "3"
    assert "--limit" not in command
    assert command[command.index("--model_args") + 1].startswith(
        "model=/m,base_url=http://h:1/v1/completions,num_concurrent=65,"
    )
    custom = check_entry({**entry.fields, "client_command": "lm_eval ${NOPE}"}, 0)
    with pytest.raises(CatalogError, match=r"\$\{NOPE\}"):
        custom.client_command(values)


def good_fields():
    return dict(find_entry(ENTRIES, "Kimi-K3 DSpark PP2").fields)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"acceptance_min": 50}, "a fraction"),
        ({"accuracy_threshold": 94.0}, "a fraction"),
        ({"mtp_accept_threshold": 0.5}, "unknown fields"),
        ({"gpus": "8"}, "type str"),
        ({"platform": "tpu"}, "platform"),
        ({"runner": ["self-hosted", "linux", "cuda"]}, "runner labels"),
        ({"test_level": "weekly"}, "test_level"),
        ({"log_markers": {"relay": 4}}, "log_markers"),
        ({"extraArgs": "--model x -tp 8"}, "must not set --model"),
        ({"extraArgs": "-tp 8 --chat-template 'unclosed"}, "quotation"),
        ({"env_vars": "NOT AN ASSIGNMENT"}, "NAME=VALUE"),
    ],
)
def test_bad_entries_are_refused_by_name(change, message):
    with pytest.raises(CatalogError, match=message):
        check_entry({**good_fields(), **change}, 3)


def test_a_missing_field_and_duplicate_names_are_refused(tmp_path):
    fields = good_fields()
    del fields["gpus"]
    with pytest.raises(CatalogError, match="missing field 'gpus'"):
        check_entry(fields, 0)
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps([good_fields(), good_fields()]))
    with pytest.raises(CatalogError, match="duplicate model_name"):
        load_catalog(path)


def test_env_vars_reach_the_server_environment():
    entry = check_entry({**good_fields(), "env_vars": "A=1\n\nB=x=y\n"}, 0)
    assert entry.env() == {"A": "1", "B": "x=y"}


def test_cli_prints_nul_separated_arguments_and_exits_2_on_an_unknown_entry(capsys):
    assert catalog.main(["serve-args", "Kimi-K3 DSpark PP2", "--models-dir", "/m"]) == 0
    args = capsys.readouterr().out.split("\0")[:-1]
    assert args[:2] == ["--model", "/m/moonshotai/Kimi-K3"]
    assert shlex.join(args[2:]).startswith("-pp 2 -tp 4")
    assert catalog.main(["serve-args", "No such entry"]) == 2
    assert "no catalog entry named 'No such entry'" in capsys.readouterr().err
