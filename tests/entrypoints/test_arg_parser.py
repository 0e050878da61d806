import argparse
import dataclasses

import pytest

from atom.entrypoints.cli import make_parser
from atom.entrypoints.openai.api_server import add_server_args
from atom.model_engine.arg_utils import EngineArgs
from atom.utils.arg_parser import FlexibleArgumentParser


def engine_parser() -> FlexibleArgumentParser:
    return EngineArgs.add_cli_args(FlexibleArgumentParser())


def parse_engine_args(*argv: str) -> EngineArgs:
    return EngineArgs.from_cli_args(engine_parser().parse_args(list(argv)))


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-model-len", "128"],
        ["--max_model_len", "128"],
        ["--max-model-len=128"],
        ["--max_model_len=128"],
        ["--max-model_len", "128"],
    ],
)
def test_kebab_and_snake_spellings_are_one_flag(argv):
    assert parse_engine_args(*argv).max_model_len == 128


def test_snake_registered_flag_accepts_kebab():
    parser = FlexibleArgumentParser()
    parser.add_argument("--enable_thing", type=int, default=0)
    assert parser.parse_args(["--enable-thing", "3"]).enable_thing == 3
    assert parser.parse_args(["--enable_thing=4"]).enable_thing == 4


def test_values_are_not_rewritten():
    args = parse_engine_args("--model", "/models/my_model", "--draft_model", "a_b")
    assert args.model == "/models/my_model"
    assert args.draft_model == "a_b"


@pytest.mark.parametrize(
    "flag", ["--no-enable-prefix-caching", "--no-enable_prefix_caching"]
)
def test_no_flags_turn_booleans_off(flag):
    assert parse_engine_args().enable_prefix_caching is True
    assert parse_engine_args(flag).enable_prefix_caching is False
    assert parse_engine_args("--no-enable-chunked-prefill").enable_chunked_prefill is (
        False
    )


def test_store_true_flags_gain_a_no_form():
    parser = FlexibleArgumentParser()
    parser.add_argument("--fast", action="store_true")
    group = parser.add_argument_group("grouped")
    group.add_argument("--loud_mode", action="store_true")
    assert parser.parse_args([]).fast is False
    assert parser.parse_args(["--fast"]).fast is True
    assert parser.parse_args(["--fast", "--no-fast"]).fast is False
    assert parser.parse_args(["--loud-mode"]).loud_mode is True
    assert parser.parse_args(["--loud_mode", "--no-loud-mode"]).loud_mode is False


def test_cuda_graph_flags():
    args = parse_engine_args("--cudagraph-capture-sizes", "[1,2,8]", "--enforce-eager")
    assert args.cudagraph_capture_sizes == [1, 2, 8] and args.enforce_eager
    assert parse_engine_args().cudagraph_capture_sizes is None
    sizes = parse_engine_args("--prefill-capture-sizes", "16,64").prefill_capture_sizes
    assert sizes == (16, 64)
    assert (
        parse_engine_args("--prefill-capture-sizes", "[]").prefill_capture_sizes == ()
    )
    assert parse_engine_args().prefill_capture_sizes == (16, 32, 64, 128, 256)


PTPC_FP8 = '{"global_quant_config": "ptpc_fp8"}'


@pytest.mark.parametrize("flag", ["--online_quant_config", "--online-quant-config"])
def test_online_quant_config_in_either_spelling(flag):
    assert parse_engine_args(flag, PTPC_FP8).online_quant_config == PTPC_FP8
    assert parse_engine_args().online_quant_config is None


@pytest.mark.parametrize("flag", ["--kv_cache_dtype", "--kv-cache-dtype"])
@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3"])
def test_kv_cache_dtype_in_either_spelling(flag, value):
    assert parse_engine_args(flag, value).kv_cache_dtype == value
    assert parse_engine_args().kv_cache_dtype == "auto"


def test_unknown_online_scheme_is_a_parse_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        parse_engine_args("--online_quant_config", '{"global_quant_config": "fp4"}')
    err = capsys.readouterr().err
    assert "--online_quant_config: unknown global_quant_config 'fp4'" in err
    assert "supported: ptpc_fp8" in err


def test_short_parallel_flags():
    args = parse_engine_args("-tp", "4", "-pp", "2", "--pp_layer_partition", "3,2")
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (4, 2)
    assert args.pp_layer_partition == [3, 2]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--enable-dp-attention"], "--enable-dp-attention is not supported by atom"),
        (["--enable_expert_parallel"], "--enable-expert-parallel is not supported"),
        (["--data-parallel-size", "2"], "--data-parallel-size is not supported"),
        (["-dp", "2"], "-dp is not supported by atom"),
        (["--cudagraph-mode", "FULL"], "--cudagraph-mode is not supported"),
        (["--port", "8000"], "use --server-port"),
    ],
)
def test_unsupported_flags_are_rejected_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        engine_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-model"], "unrecognized arguments"),  # no prefix matching
        (["--device", "tpu"], "invalid choice"),
        (["-tp", "0"], "expected a positive integer"),
        (["--pp-layer-partition", "3,x"], "comma list of integers"),
        (["--pp-layer-partition", "3,0"], "at least one layer"),
        (["--method", "medusa"], "invalid choice"),
        (["--method", "eagle3"], "invalid choice: 'eagle3'"),
        (["--method", "mtp"], "invalid choice"),
        (["--kv-role", "kv_consumer"], "invalid choice: 'kv_consumer'"),
        (["--cudagraph-capture-sizes", "[1,x]"], "list of integers"),
        (["--cudagraph-capture-sizes", "[0]"], "positive integers"),
        (["--cudagraph-capture-sizes", "[]"], "at least one size"),
        (["--prefill-capture-sizes", "[16,0]"], "positive integers"),
        (
            ["--kv_cache_dtype", "fp8_e5m2"],
            "argument --kv-cache-dtype: invalid choice: 'fp8_e5m2' (choose from "
            "'auto', 'fp8', 'fp8_e4m3')",
        ),
    ],
)
def test_bad_values_fail_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit):
        engine_parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_cli_defaults_match_the_dataclass():
    parsed = parse_engine_args()
    assert parsed == EngineArgs()
    for field in dataclasses.fields(EngineArgs):
        assert getattr(parsed, field.name) == field.default, field.name


def test_engine_kwargs_leave_unset_optionals_to_the_engine():
    kwargs = parse_engine_args("--seed", "3").engine_kwargs()
    assert kwargs["model"] == "tiny-kimi-k3"
    assert kwargs["seed"] == 3
    assert kwargs["max_num_seqs"] == 64
    for unset in ["tokenizer", "max_model_len", "num_kvcache_blocks", "method"]:
        assert unset not in kwargs
    assert "trust_remote_code" not in kwargs  # accepted by the CLI only


def test_engine_kwargs_are_all_config_fields():
    from atom.config import Config

    config_fields = {field.name for field in dataclasses.fields(Config)}
    kwargs = parse_engine_args("--method", "dspark", "--seed", "1").engine_kwargs()
    assert set(kwargs) <= config_fields


@pytest.mark.parametrize(
    "model, draft",
    [
        ("tiny-kimi-k3", "tiny-kimi-k3-dspark"),
        ("tiny-kimi-k31", "tiny-kimi-k31-dspark"),
    ],
)
def test_dspark_on_a_tiny_model_defaults_its_draft(model, draft):
    assert parse_engine_args("--model", model, "--method", "dspark").draft_model == (
        draft
    )
    explicit = parse_engine_args("--model", model, "--method=dspark", "--draft-model=d")
    assert explicit.draft_model == "d"
    assert parse_engine_args("--model", model).draft_model is None
    assert parse_engine_args("--model", "/x", "--method", "dspark").draft_model is None


def test_server_parser_has_server_and_engine_flags():
    args = add_server_args(FlexibleArgumentParser()).parse_args(
        [
            "--server_port",
            "9001",
            "--served-model-name",
            "kimi",
            "--default-chat-template-kwargs",
            '{"thinking": false}',
            "--no-enable_prefix_caching",
            "--disable_uvicorn_access_log",
        ]
    )
    assert (args.host, args.server_port, args.timeout_keep_alive) == (
        "127.0.0.1",
        9001,
        5,
    )
    assert args.api_key is None and args.max_request_body_bytes == 8 * 1024 * 1024
    assert args.served_model_name == "kimi"
    assert args.default_chat_template_kwargs == {"thinking": False}
    assert args.disable_uvicorn_access_log is True
    assert EngineArgs.from_cli_args(args).enable_prefix_caching is False


def test_server_rejects_a_non_object_template_kwargs(capsys):
    with pytest.raises(SystemExit):
        add_server_args(FlexibleArgumentParser()).parse_args(
            ["--default-chat-template-kwargs", "[1]"]
        )
    assert "expected a JSON object" in capsys.readouterr().err


def test_atom_console_script_subcommands():
    parser = make_parser()
    serve = parser.parse_args(["serve", "--model", "m", "--server-port", "1234"])
    assert (serve.command, serve.model, serve.server_port) == ("serve", "m", 1234)
    generate = parser.parse_args(
        ["generate", "--prompt", "a", "--prompt", "b", "--max_tokens", "5", "-tp", "2"]
    )
    assert generate.command == "generate"
    assert generate.prompt == ["a", "b"]
    assert (generate.max_tokens, generate.temperature) == (5, 0.0)
    assert EngineArgs.from_cli_args(generate).tensor_parallel_size == 2
    assert isinstance(generate, argparse.Namespace)


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    commands = next(
        action
        for action in make_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    return dict(commands.choices)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_option_has_help_and_shows_its_default(command):
    parser = subcommand_parsers()[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        assert action.help, f"{action.option_strings} has no help text"
        assert "(default: " in formatter._expand_help(action), action.option_strings


@pytest.mark.parametrize("seed", ["1e23", str(2**64), str(2**63), "-1", "seven"])
def test_seed_out_of_range_is_a_clean_parse_error(seed, capsys):
    with pytest.raises(SystemExit) as exit_info:
        make_parser().parse_args(["generate", "--seed", seed])
    assert exit_info.value.code == 2
    assert "--seed: expected an integer in [0, 2**63 - 1]" in capsys.readouterr().err


def test_largest_seed_and_api_key_parse():
    args = make_parser().parse_args(["generate", "--seed", str(2**63 - 1)])
    assert args.seed == 2**63 - 1
    serve = make_parser().parse_args(["serve", "--api-key", "k", "--host", "0.0.0.0"])
    assert (serve.api_key, serve.host) == ("k", "0.0.0.0")
