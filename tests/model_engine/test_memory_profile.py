"""The memory profile's steps run on the real tiny K3 with DSpark, writing only the
scratch rows of a cache that has nothing else; on CPU there is no device memory
to measure, so this checks that every profiled step is a valid forward. The CUDA
budget itself is exercised by every engine start on a GPU
(`tests/models/test_cuda_graphs.py`)."""

import torch

from atom import LLMEngine, SamplingParams
from atom.config import Config
from atom.model_engine.memory_profile import (
    ActivationPeaks,
    profile_block_pass,
    profile_decode,
    profile_prefill,
    profile_short_prefill,
)
from atom.model_engine.model_runner import ModelRunner


def test_profile_steps_write_only_the_scratch_rows():
    config = Config(
        model="tiny-kimi-k3",
        device="cpu",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=160,
        method="dspark",
        draft_model="tiny-kimi-k3-dspark",
        num_speculative_tokens=3,
        prefill_capture_sizes=(16, 64),
    )
    runner = ModelRunner(config, torch.device("cpu"))
    runner.cache = runner._cache_engine(num_blocks=0, num_state_slots=0)
    layer = runner.cache.kv_layers[0]
    assert layer.kv_cache.shape[0] == 1  # the scratch block alone
    with torch.inference_mode():
        profile_prefill(runner)
        assert layer.kv_cache.abs().sum() > 0
        profile_decode(runner)
        profile_short_prefill(runner)
        profile_block_pass(runner)


def test_graph_pools_are_kept_beside_the_eager_peak():
    peaks = ActivationPeaks(prefill=5, decode=3, block_pass=2)
    assert peaks.reserved(with_graphs=True) == 10
    assert peaks.reserved(with_graphs=False) == 5


def test_close_gives_the_runner_back():
    llm = LLMEngine("tiny-kimi-k3", device="cpu", max_model_len=128, max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params)[0]["token_ids"]) == 4
    llm.close()
    assert llm.workers.runner is None
    llm.close()  # twice is harmless
