"""Captured graphs replay the eager forward (CUDA only; skipped elsewhere).

Runs the real tiny K3 through the real ModelRunner: after one prefill, a decode step
through the graph and the same step run eagerly from the same caches give the same
logits and the same cache rows (KV, recurrent state and, for a verify, the per-row
snapshots), for batch sizes that need padding, with one row per sequence and with
the T + 1 rows of a DSpark verify; a short prompt's prefill through its captured
token count (filling it, or padded by a dummy sequence) does the same. End to end,
DSpark with captured target and block-pass graphs emits exactly the eager
target-only greedy tokens, prompts prefilled together or one at a time through their
captures; pp2 (two ranks sharing the GPU, graphs on both stages,
with and without DSpark) and pp2 x tp2 give the pp1 ids (fp32). The graph == eager
check also runs with ptpc_fp8 weights and an fp8 KV cache.
"""

import pytest
import torch

from atom import LLMEngine, SamplingParams
from atom.config import Config
from atom.model_engine.cuda_graph import DecodeShape, PrefillShape
from atom.model_engine.model_runner import ModelRunner
from tests.models.kimi_helpers import work
from tests.spec_decode.spec_helpers import runner_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BLOCK = 16
NUM_BLOCKS = 64
BLOCKS_PER_SEQ = 8
# One-prompt prefills captured too, by token count (off by default).
PREFILL_SIZES = (16, 32, 64)
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "bfloat16+fp8": 5e-2}
# "+fp8": ptpc_fp8 weights and an fp8 KV cache, whose kernels the graphs capture too.
FP8 = dict(
    online_quant_config={"global_quant_config": "ptpc_fp8"}, kv_cache_dtype="fp8"
)


def build_runner(dtype: str, num_drafts: int) -> ModelRunner:
    dtype, _, quantized = dtype.partition("+")
    spec = dict(FP8) if quantized else {}
    if num_drafts:
        spec |= dict(
            method="dspark",
            draft_model="tiny-kimi-k3-dspark",
            num_speculative_tokens=num_drafts,
        )
    config = Config(
        model="tiny-kimi-k3",
        device="cuda",
        dtype=dtype,
        block_size=BLOCK,
        max_model_len=256,
        max_num_seqs=8,
        num_kvcache_blocks=NUM_BLOCKS,
        cudagraph_capture_sizes=[1, 2, 4, 8],
        prefill_capture_sizes=PREFILL_SIZES,
        **spec,
    )
    runner = ModelRunner(config, torch.device("cuda"))
    runner.allocate_caches(NUM_BLOCKS)
    return runner


def request_rows(runner: ModelRunner) -> list[torch.Tensor]:
    """Views of every request-owned cache row; the scratch block and slot, where
    only a graph's padding sequences write, are left out."""
    cache = runner.cache
    blocks, slots = cache.num_blocks, cache.num_state_slots
    views = [m.kv_cache[:blocks] for m in cache.kv_layers]
    for m in cache.state_layers:
        views += [m.ssm_state[:slots], m.conv_state[:slots]]
        if m.ssm_snapshots is not None:
            views += [m.ssm_snapshots[:slots], m.conv_snapshots[:slots]]
    return views


def snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [view.clone() for view in request_rows(runner)]


def restore(runner: ModelRunner, saved: list[torch.Tensor]) -> None:
    for view, value in zip(request_rows(runner), saved, strict=True):
        view.copy_(value)


def decode_step(prompts: list[list[int]], num_drafts: int) -> list:
    """The step after each prompt's prefill: its next token and num_drafts drafts."""
    return [
        work(
            [7 + i + j for j in range(num_drafts + 1)],
            len(prompt),
            slot=i,
            num_drafts=num_drafts,
            first_block=BLOCKS_PER_SEQ * i,
            num_blocks=BLOCKS_PER_SEQ,
        )
        for i, prompt in enumerate(prompts)
    ]


@pytest.fixture(scope="module")
def runners():
    """One runner per (dtype, drafts), shared by its batch sizes: building and
    capturing costs more than a case, and each case prefills its own sequences
    (fresh recurrent states, every cache row it reads written by that prefill)."""
    built: dict[tuple[str, int], ModelRunner] = {}

    def get(dtype: str, num_drafts: int) -> ModelRunner:
        if (dtype, num_drafts) not in built:
            built[dtype, num_drafts] = build_runner(dtype, num_drafts)
        return built[dtype, num_drafts]

    yield get
    built.clear()
    torch.cuda.empty_cache()


def assert_replay_equals_eager(runner: ModelRunner, step: list, key, tol: float):
    """`step` replayed through the capture of `key` and run eagerly from the same
    caches give the same logits and the same cache rows."""
    with torch.inference_mode():
        before = snapshot(runner)
        graph_out, _, _ = runner._forward(step, None, key)
        graph_logits = runner.model.compute_logits(graph_out).float()
        graph_caches = snapshot(runner)
        restore(runner, before)
        eager_out, positions, slot_mapping = runner._forward(step, None, None)
        if runner.graphs.after_forward is not None:
            # The graph wrote the draft's context rows too; eagerly the runner
            # writes them after the forward (model_runner._sample_and_draft).
            runner.drafter.precompute_context_kv(
                positions, slot_mapping, positions.numel()
            )
        eager_logits = runner.model.compute_logits(eager_out).float()
        eager_caches = snapshot(runner)
    assert graph_logits.shape[0] == sum(len(w.token_ids) for w in step)
    torch.testing.assert_close(graph_logits, eager_logits, atol=tol, rtol=tol)
    written = 0
    for graph_rows, eager_rows, old_rows in zip(graph_caches, eager_caches, before):
        torch.testing.assert_close(
            graph_rows.float(), eager_rows.float(), atol=tol, rtol=tol
        )
        written += int(not torch.equal(eager_rows, old_rows))
    # The comparison covers rows the step really wrote: every KV layer and state.
    assert written >= len(runner.cache.kv_layers) + len(runner.cache.state_layers)


@pytest.mark.parametrize("num_drafts", [0, 3], ids=["1-row", "verify-4-rows"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16+fp8"])
@pytest.mark.parametrize("num_seqs", [1, 3, 6])
def test_graph_decode_equals_eager_decode(runners, num_seqs, dtype, num_drafts):
    runner = runners(dtype, num_drafts)
    assert runner.graphs is not None, "the tiny K3 must capture on CUDA"
    gen = torch.Generator().manual_seed(num_seqs)
    prompts = [
        torch.randint(0, 1000, (20 + 3 * i,), generator=gen).tolist()
        for i in range(num_seqs)
    ]
    with torch.inference_mode():
        runner._forward(
            [
                work(
                    p, slot=i, first_block=BLOCKS_PER_SEQ * i, num_blocks=BLOCKS_PER_SEQ
                )
                for i, p in enumerate(prompts)
            ],
            None,
            None,
        )
    step = decode_step(prompts, num_drafts)
    key = runner.graphs.shape_for(step)
    size = next(s for s in (1, 2, 4, 8) if s >= num_seqs)
    assert key == DecodeShape(size, num_drafts + 1)
    assert_replay_equals_eager(runner, step, key, TOLERANCE[dtype])


@pytest.mark.parametrize("num_drafts", [0, 3], ids=["target", "dspark"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("length", [32, 21], ids=["fills-32", "padded-to-32"])
def test_graph_prefill_equals_eager_prefill(runners, length, dtype, num_drafts):
    """A short prompt's prefill through its captured shape writes what the eager
    prefill writes (KV, states and, with DSpark, the draft's context rows) and
    gives the same logits."""
    runner = runners(dtype, num_drafts)
    gen = torch.Generator().manual_seed(length)
    prompt = torch.randint(0, 1000, (length,), generator=gen).tolist()
    step = [work(prompt, slot=2, first_block=2 * BLOCKS_PER_SEQ)]
    key = runner.graphs.shape_for(step)
    assert key == PrefillShape(32, padded=length < 32)
    assert_replay_equals_eager(runner, step, key, TOLERANCE[dtype])


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
COMMON = dict(
    device="cuda",
    max_num_seqs=8,
    max_model_len=256,
    prefill_capture_sizes=PREFILL_SIZES,
)
DSPARK = dict(
    method="dspark", draft_model="tiny-kimi-k3-dspark", num_speculative_tokens=7
)


def prompts_for_layouts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 1000, (12 + 5 * i,), generator=gen).tolist() for i in range(5)
    ]


def generate_ids(dtype: str, **settings) -> list[list[int]]:
    llm = LLMEngine("tiny-kimi-k3", dtype=dtype, **COMMON, **settings)
    try:
        outputs = llm.generate(prompts_for_layouts(), GREEDY)
        if settings.get("method"):
            assert llm.get_spec_decode_stats()["num_verify_steps"] > 0
        if settings.get("pipeline_parallel_size", 1) > 1:
            graphs = llm.workers.call(captured_graphs)
            if (
                not settings.get("enforce_eager")
                and settings.get("tensor_parallel_size", 1) == 1
            ):
                assert all(count > 0 for count in graphs), graphs
        return [o["token_ids"] for o in outputs]
    finally:
        llm.close()


def captured_graphs(runner: ModelRunner) -> int:
    """Graphs this rank captured (0 when it runs eagerly)."""
    return len(runner.graphs.captures) if runner.graphs is not None else 0


def dspark_ids_and_acceptance(**settings) -> tuple[list[list[int]], float]:
    llm = LLMEngine("tiny-kimi-k3", dtype="float32", **COMMON, **DSPARK, **settings)
    try:
        ids = [o["token_ids"] for o in llm.generate(prompts_for_layouts(), GREEDY)]
        runner = runner_of(llm)
        if not settings.get("enforce_eager"):
            assert runner.graphs is not None
            # The draft's context rows are written inside the decode graphs, and
            # the greedy drafts come out of the block-pass graphs.
            assert runner.graphs.after_forward is not None
            assert runner.drafter.block_graphs.captures
        stats = llm.get_spec_decode_stats()
        assert stats["num_verify_steps"] > 0
        return ids, stats["acceptance_rate"]
    finally:
        llm.close()


def test_dspark_with_graphs_emits_the_eager_target_only_tokens():
    eager = generate_ids("float32", enforce_eager=True)
    ids, rate = dspark_ids_and_acceptance()
    assert ids == eager
    # Graphs change where the draft's context is written and how the greedy drafts
    # are decoded, not what: the eager DSpark run accepts as often (fp32, so only a
    # near-tie may round apart).
    eager_ids, eager_rate = dspark_ids_and_acceptance(enforce_eager=True)
    assert eager_ids == eager
    assert rate == pytest.approx(eager_rate, abs=0.02)


def test_prompts_alone_prefill_through_their_graphs_and_decode_as_eager():
    """Each prompt alone in its step: its prefill replays the capture of its token
    count (the capture's static inputs hold the prompt afterwards), and DSpark with
    graphs still emits the eager target-only tokens."""
    eager = generate_ids("float32", enforce_eager=True)
    # Without the prefix cache: with it, a prompt past a block boundary prefills
    # its whole blocks first (their KDA state saved for reuse) and the rest next.
    llm = LLMEngine(
        "tiny-kimi-k3",
        dtype="float32",
        enable_prefix_caching=False,
        **COMMON,
        **DSPARK,
    )
    try:
        captures = runner_of(llm).graphs.captures
        ids = []
        for prompt in prompts_for_layouts():
            ids.append(llm.generate([prompt], GREEDY)[0]["token_ids"])
            size = next(s for s in PREFILL_SIZES if s >= len(prompt))
            replayed = captures[PrefillShape(size, padded=size > len(prompt))]
            assert replayed.packed[: len(prompt)].tolist() == prompt
    finally:
        llm.close()
    assert ids == eager


@pytest.fixture(scope="module")
def pp1_ids() -> list[list[int]]:
    """The fp32 pp1 greedy ids every layout must reproduce."""
    return generate_ids("float32")


def test_pp2_graphs_on_both_stages_give_the_pp1_ids(pp1_ids):
    assert generate_ids("float32", pipeline_parallel_size=2) == pp1_ids
    assert generate_ids("float32", pipeline_parallel_size=2, **DSPARK) == pp1_ids


def test_pp2_tp2_sharing_one_gpu_gives_the_pp1_ids_in_fp32():
    # fp32 only: in bf16 TP splits the reductions, so rounding (not the layout)
    # decides near-tied tokens. Both runs take the torch KDA backend: TP halves the
    # KDA heads per rank, and fla autotunes per head count (a 4-rank engine took
    # 107 s on an H200, most of it tuning), while fla itself is checked elsewhere.
    torch_kda = dict(kda_backend="torch")
    layout = dict(pipeline_parallel_size=2, tensor_parallel_size=2)
    pp1 = generate_ids("float32", **torch_kda)
    assert generate_ids("float32", **layout, **torch_kda) == pp1


def test_two_engines_in_one_process_both_start_and_generate():
    """The first engine's device memory (weights, KV cache, graph pools) comes back
    on close(), so a second engine with the default settings starts."""
    outputs = []
    for _ in range(2):
        llm = LLMEngine("tiny-kimi-k3", device="cuda")
        try:
            outputs.append(llm.generate([[5, 6, 7, 8]], GREEDY)[0]["token_ids"])
            assert runner_of(llm).graphs is not None
        finally:
            llm.close()
    assert outputs[0] == outputs[1] and len(outputs[0]) == GREEDY.max_tokens
