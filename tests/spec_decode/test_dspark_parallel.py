"""DSpark under real multi-process pipeline and tensor parallelism (gloo).

Each rank builds the tiny K3 target for its stage; the last stage builds the
drafter. One prefill runs stage after stage with the tap relay riding in the
payload, then the last stage writes context rows and proposes. Taps and drafts
must equal the single-process run, and every TP rank must draft the same tokens.
"""

import pytest
import torch

from atom.config import Config
from atom.distributed.launch import run_ranks
from atom.distributed.parallel_state import get_pp_group
from atom.distributed.pp_comm import recv_tensor_dict, send_tensor_dict
from atom.model_engine.batch import SeqWork
from atom.model_engine.cache_engine import CacheEngine
from atom.model_engine.model_inputs import prepare_inputs
from atom.model_loader.loader import load_weights
from atom.models.registry import get_model_class
from atom.models.utils import IntermediateTensors
from atom.spec_decode.dspark_drafter import DSparkDrafter
from atom.spec_decode.pp_aux_relay import AUX_KEY, PPAuxRelay
from atom.utils.forward_context import ForwardContext, set_forward_context
from tests.spec_decode.spec_helpers import propose_on_host

PROMPT = [5, 77, 301, 9, 640, 12, 999, 58, 410, 3]
TABLE, BLOCK_SIZE, T = list(range(8)), 4, 3


def prefill_and_propose(rank: int, tp: int, pp: int):
    config = Config(
        model="tiny-kimi-k3",
        method="dspark",
        draft_model="tiny-kimi-k3-dspark",
        num_speculative_tokens=T,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_num_batched_tokens=64,
        block_size=BLOCK_SIZE,
    )
    target = get_model_class(config.hf_config.architecture)(config)
    load_weights(target, config.model)
    stage = get_pp_group()
    base = target.language_model.model
    draft_cfg = config.speculative_config.draft_hf_config
    relay = PPAuxRelay(base, draft_cfg["target_layer_ids"], 128, 64) if pp > 1 else None
    drafter = DSparkDrafter(config) if stage.is_last_rank else None
    if drafter is not None:
        drafter.load_model(target)
    modules = [target] + ([drafter.model] if drafter else [])
    CacheEngine(modules, 8, BLOCK_SIZE, 1, 0, "cpu", torch.float32)
    work = SeqWork(
        seq_id=0, token_ids=PROMPT, context_len=0, block_table=TABLE, state_slot=0
    )
    ids, positions, metadata = prepare_inputs([work], BLOCK_SIZE, "cpu")
    n = ids.numel()
    received, taps_in = None, None
    if not stage.is_first_rank:
        payload = recv_tensor_dict(torch.device("cpu"))
        taps_in = payload.pop(AUX_KEY, None)
        received = IntermediateTensors(payload)
    with torch.inference_mode(), set_forward_context(ForwardContext(metadata)):
        out = target(ids, positions, received)
    if not stage.is_last_rank:
        payload = dict(out.items())
        payload[AUX_KEY] = relay.pack(taps_in, n)
        send_tensor_dict(payload)
        return None
    relayed = relay.unpack(taps_in, n) if relay is not None else None
    drafter.precompute_context_kv(positions, metadata.slot_mapping, n, relayed)
    greedy = propose_on_host(drafter, [42], [n], [TABLE], [0.0]).ids
    sampled = propose_on_host(drafter, [42], [n], [TABLE], [0.8], [0.95], seeds=[5])
    sampled, probs = sampled.ids, sampled.probs
    taps = drafter.gather_taps(n, relayed)
    # numpy pickles by value; tensors would travel as shared-memory handles that
    # die with the rank process.
    return tuple(t.numpy() for t in (taps, greedy, sampled, probs))


@pytest.fixture(scope="module")
def single():
    return as_tensors(run_ranks(prefill_and_propose, tp_size=1, args=(1, 1))[0])


def as_tensors(arrays) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(a) for a in arrays)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 1)])
def test_parallel_drafts_match_a_single_process(single, tp, pp):
    results = run_ranks(prefill_and_propose, tp_size=tp, pp_size=pp, args=(tp, pp))
    last_stage = [as_tensors(r) for r in results if r is not None]
    assert len(last_stage) == tp
    taps, greedy, sampled, probs = single
    for rank_taps, rank_greedy, rank_sampled, rank_probs in last_stage:
        if tp == 1:
            # The relay only copies: pp2 taps are bit-identical to pp1.
            assert torch.equal(rank_taps, taps)
        else:
            torch.testing.assert_close(rank_taps, taps, atol=1e-4, rtol=1e-4)
        assert torch.equal(rank_greedy, greedy)
        assert torch.equal(rank_sampled, sampled)
        torch.testing.assert_close(rank_probs, probs, atol=1e-5, rtol=1e-4)
    first = last_stage[0]
    for other in last_stage[1:]:  # identical drafts and q on every TP rank
        assert torch.equal(other[2], first[2]) and torch.equal(other[3], first[3])
