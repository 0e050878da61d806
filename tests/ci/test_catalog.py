"""The GPU accuracy catalog: the committed entries, aggregated and P/D, and the
checks on bad ones."""

import json
import shlex

import pytest

from atom.entrypoints.openai.api_server import add_server_args
from atom.kv_transfer.config import KVTransferConfig
from atom.kv_transfer.factory import check_connector_name
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
    "Kimi-K3 DSpark PP2 P/D",
    "MiniMax-M3 DSpark PP4 P/D",
]
SERVERS = [(entry, side) for entry in ENTRIES for side in entry.sides()]


def server_args(entry, side=None):
    parser = add_server_args(FlexibleArgumentParser(prog="atom serve"))
    return parser.parse_args(entry.serve_args("/models", side))


def server_gpus(entry, side):
    args = server_args(entry, side)
    return args.tensor_parallel_size * args.pipeline_parallel_size


def test_the_required_entries_exist():
    names = [entry.name for entry in ENTRIES]
    assert set(REQUIRED) <= set(names)


@pytest.mark.parametrize(
    "entry, side", SERVERS, ids=lambda x: x.slug if hasattr(x, "slug") else str(x)
)
def test_every_server_parses_as_atom_serve_flags_and_fills_its_gpus(entry, side):
    args = server_args(entry, side)
    assert args.model == f"/models/{entry.fields['model_path']}"
    gpus = entry.pd[side]["gpus"] if side else entry.fields["gpus"]
    assert server_gpus(entry, side) == gpus
    markers = entry.producer_log_markers if side == "producer" else entry.log_markers
    if args.method == "dspark":
        assert args.draft_model.startswith("/models/")
        # Every stage but the last arms taps for the relay, once per TP rank.
        pp, tp = args.pipeline_parallel_size, args.tensor_parallel_size
        assert markers["relay"] == (pp - 1) * tp
    else:
        assert entry.acceptance_min is None
        assert markers == {"relay": 0, "kda_rollback": 0}
    if side is None:
        assert args.kv_transfer_config is None
    else:
        config = KVTransferConfig.parse(args.kv_transfer_config)
        assert config.kv_role == f"kv_{side}"
        assert check_connector_name(config) == "atom.kv_transfer.mooncake_connector"
        assert config.protocol == "rdma"  # GPU memory between two processes


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e.pd], ids=lambda e: e.slug)
def test_pd_sides_share_the_model_settings_and_split_the_runner(entry):
    producer, consumer = (server_args(entry, side) for side in ("producer", "consumer"))
    for setting in ("model", "method", "draft_model", "num_speculative_tokens",
                    "block_size", "kv_cache_dtype", "tensor_parallel_size"):  # fmt: skip
        assert getattr(producer, setting) == getattr(consumer, setting), setting
    devices = entry.devices("producer") + entry.devices("consumer")
    assert devices == list(range(entry.fields["gpus"]))
    variable = catalog.VISIBLE_DEVICES[entry.fields["platform"]]
    assert entry.env("consumer")[variable] == ",".join(
        str(d) for d in entry.devices("consumer")
    )
    assert variable not in entry.env()


def test_the_kimi_pd_entry_is_the_upstream_pp2_producer_with_an_equal_tp_consumer():
    entry = find_entry(ENTRIES, "Kimi-K3 DSpark PP2 P/D")
    producer = server_args(entry, "producer")
    consumer = server_args(entry, "consumer")
    assert (producer.pipeline_parallel_size, producer.tensor_parallel_size) == (2, 4)
    assert (consumer.pipeline_parallel_size, consumer.tensor_parallel_size) == (1, 4)
    assert producer.method == "dspark" and producer.num_speculative_tokens == 7
    pp2 = find_entry(ENTRIES, "Kimi-K3 DSpark PP2")
    for field in ("accuracy_threshold", "acceptance_min"):
        assert entry.fields[field] == pp2.fields[field]
    # The producer starts as the PP2 entry does; the consumer is the tp4 half.
    assert (
        entry.producer_log_markers == pp2.log_markers == {"relay": 4, "kda_rollback": 8}
    )
    assert entry.log_markers == {"relay": 0, "kda_rollback": 4}
    assert entry.env("producer") == {"HIP_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert entry.env("consumer") == {"HIP_VISIBLE_DEVICES": "8,9,10,11"}
    assert entry.checkpoints() == ["moonshotai/Kimi-K3", "Inferact/Kimi-K3-DSpark"]
    # 12 GPUs: no scheduled level runs it on the 8-GPU runners.
    assert entry.fields["test_level"] == "manual"


def test_the_minimax_pd_entry_has_a_pp4_producer_on_one_runner():
    entry = find_entry(ENTRIES, "MiniMax-M3 DSpark PP4 P/D")
    producer = server_args(entry, "producer")
    assert producer.pipeline_parallel_size == 4
    assert producer.draft_model == "/models/nvidia/MiniMax-M3-DSpark"
    assert entry.fields["gpus"] == 8 and "gpu-8" in entry.fields["runner"]
    assert entry.fields["test_level"] == "nightly"
    assert (
        entry.producer_log_markers
        == entry.log_markers
        == {
            "relay": 3,
            "kda_rollback": 0,
        }
    )


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
        for level in catalog.LEVELS_RUN
    }
    assert set(rows["pr"]) <= set(rows["main"]) <= set(rows["nightly"])
    scheduled = [e.name for e in ENTRIES if e.fields["test_level"] != "manual"]
    assert rows["nightly"] == scheduled
    assert "Kimi-K3 DSpark PP2" in rows["pr"]
    assert "MiniMax-M3 DSpark PP4 P/D" in rows["nightly"]
    only = catalog.matrix(ENTRIES, "pr", ["MiniMax-M3 DSpark PP2"])
    assert [row["slug"] for row in only] == ["MiniMax-M3-DSpark-PP2"]
    assert only[0]["runner"][:1] == ["self-hosted"] and only[0]["pd"] is False
    manual = catalog.matrix(ENTRIES, "nightly", ["Kimi-K3 DSpark PP2 P/D"])
    assert manual[0]["pd"] is True and manual[0]["gpus"] == 12
    with pytest.raises(CatalogError, match="level must be one of"):
        catalog.matrix(ENTRIES, "manual", [])


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


def good_pd_fields():
    return json.loads(json.dumps(find_entry(ENTRIES, "Kimi-K3 DSpark PP2 P/D").fields))


def pd_change(side, **changes):
    fields = good_pd_fields()
    fields["pd"][side].update(changes)
    return fields


@pytest.mark.parametrize(
    "fields, message",
    [
        (pd_change("consumer", kv_transfer_config={"kv_role": "kv_producer"}),
         "pd.consumer: kv_transfer_config kv_role must be 'kv_consumer', got 'kv_producer'"),
        (pd_change("producer", kv_transfer_config={}), "kv_role must be 'kv_producer', got None"),
        (pd_change("consumer", extraArgs="-tp 8"),
         "tensor parallel size 4 differs from the consumer's 8"),
        (pd_change("consumer", extraArgs="--tensor_parallel_size=2"), "consumer's 2"),
        (pd_change("consumer", gpus=8), r"\(8 \+ 8 = 16\), got 12"),
        (pd_change("producer", log_markers={"relay": 4}), "pd.producer: log_markers"),
        (pd_change("producer", extra="x"), r"pd.producer: unknown fields \['extra'\]"),
        (pd_change("producer", extraArgs="-tp 4 --kv-transfer-config {}"),
         "pd.producer.extraArgs must not set --kv-transfer-config"),
        (pd_change("consumer", extraArgs="-tp 4 --kv_role kv_consumer"), "--kv-role"),
        ({**good_pd_fields(), "pd": {"producer": {}}}, "pd must have exactly"),
        ({**good_pd_fields(), "log_markers": {"relay": 0, "kda_rollback": 4}},
         "not both"),
        ({**good_pd_fields(), "env_vars": "HIP_VISIBLE_DEVICES=0"},
         "must not set HIP_VISIBLE_DEVICES"),
        ({**good_pd_fields(), "runner": ["self-hosted", "rocm", "gpu-8"]},
         "runner label 'gpu-8' offers fewer GPUs than the entry's 12"),
        ({**good_fields(), "extraArgs": "-tp 8 --kv-transfer-config {}"},
         "a P/D entry gives them per side in a pd block"),
    ],
)  # fmt: skip
def test_bad_pd_entries_are_refused_by_name(fields, message):
    with pytest.raises(CatalogError, match=message):
        check_entry(fields, 6)


def test_a_pd_entry_serves_only_by_side_and_an_aggregated_one_has_none(capsys):
    pd = find_entry(ENTRIES, "Kimi-K3 DSpark PP2 P/D")
    with pytest.raises(CatalogError, match="name its side, producer or consumer"):
        pd.serve_args("/models")
    with pytest.raises(CatalogError, match="not a P/D entry: no producer side"):
        find_entry(ENTRIES, "Kimi-K3 DSpark PP2").serve_args("/models", "producer")
    name = "MiniMax-M3 DSpark PP4 P/D"
    assert catalog.main(["serve-args", name, "--side", "consumer"]) == 0
    args = capsys.readouterr().out.split("\0")[:-1]
    assert args[-4:] == [
        "-pp", "4", "--kv-transfer-config",
        '{"kv_role":"kv_consumer","kv_connector":"mooncake","protocol":"rdma"}',
    ]  # fmt: skip
    assert catalog.main(["env", name, "--side", "consumer"]) == 0
    assert capsys.readouterr().out == "HIP_VISIBLE_DEVICES=4,5,6,7\0"
    assert catalog.main(["sides", name]) == 0
    assert capsys.readouterr().out.split() == ["producer", "consumer"]
    assert catalog.main(["sides", "Kimi-K3 DSpark PP2"]) == 0
    assert capsys.readouterr().out.split() == []
