"""The DSpark drafter: builds and loads a DSpark draft on the last stage and drives it.

`load_model(target)`: build the draft class the registry names for the draft
architecture (Kimi's K3DSparkModel or MiniMax's Qwen3DSparkModel), load it strictly,
then (unless this is a context-only producer) bind the target's embedding and LM head
and check that the bound table is real, and finally hook the target's resident taps.
After every target forward it writes the draft's context rows from the taps; per step
it runs one block pass and decodes the drafts with the Markov head.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from atom.config import Config
from atom.distributed.parallel_state import get_pp_group, get_tp_group
from atom.model_loader.loader import load_weights, parameter_bytes
from atom.model_ops.quantization.apply import prepare_quantization
from atom.model_ops.sampling_metadata import SamplingMetadata
from atom.models.interfaces import STATE_ROLLBACK_MODE
from atom.models.registry import draft_architecture, get_draft_model_class
from atom.models.utils import PPMissingLayer, language_model_of
from atom.spec_decode.aux_capture import TapCapture, allocate_tap_buffers
from atom.spec_decode.block_pass_graphs import BlockPassGraphs
from atom.spec_decode.draft_output import DraftOutput
from atom.spec_decode.drafter import Drafter
from atom.spec_decode.markov_head import markov_decode
from atom.spec_decode.pp_aux_relay import tap_is_resident

logger = logging.getLogger(__name__)


def check_shared_embedding(draft: nn.Module, will_propose: bool = True) -> None:
    """Refuse a draft whose bound embedding is a PP placeholder (or unbound).

    Inspects `draft.shared_embedding_attr` (default "embed_tokens"); a draft that
    binds its table under another name and declares nothing is skipped.
    """
    attr = getattr(draft, "shared_embedding_attr", "embed_tokens")
    if not hasattr(draft, attr):
        return
    embedding = getattr(draft, attr)
    if isinstance(embedding, PPMissingLayer):
        raise TypeError(
            f"the draft's shared {attr} is a PPMissingLayer on pp_rank "
            f"{get_pp_group().rank_in_group}: this stage built no embedding, so the "
            "draft would embed from an unloaded table. pp_holds_embedding must "
            "return True on the last stage for every method that "
            "pp_speculative_methods declares for the architecture"
        )
    if embedding is None:
        if will_propose:
            raise TypeError(
                f"the draft's shared {attr} is None although the drafter will "
                "propose; share_with_target must bind the target's embedding "
                "(see pp_holds_embedding and pp_speculative_methods)"
            )
        return
    vocab = getattr(embedding, "num_embeddings", None)
    draft_vocab = getattr(draft, "vocab_size", None)
    if vocab is not None and draft_vocab is not None and vocab != draft_vocab:
        raise ValueError(
            f"the draft's shared {attr} has {vocab} rows, the draft vocab_size is "
            f"{draft_vocab}"
        )


class DSparkDrafter(Drafter):
    """Owns the draft model, the tap buffers and tap hooks of one last stage."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        spec = config.speculative_config
        self.draft_path = spec.model
        self.draft_hf_config = spec.draft_hf_config
        self.architecture = draft_architecture(self.draft_hf_config)
        self.tap_ids: list[int] = []
        # Rows of the taps this stage computes (the rest arrive from the relay).
        self.tap_buffers: dict[int, torch.Tensor] = {}
        self.capture: TapCapture | None = None
        self.block_graphs: BlockPassGraphs | None = None
        self.own_parameter_bytes = 0
        self.shared_parameter_bytes = 0

    def load_model(self, target: nn.Module) -> None:
        """Build, load, bind to `target` (the full target model) and arm tap capture.

        Build under the caller's default device and dtype, like the target.
        """
        draft_cls = get_draft_model_class(self.architecture)
        draft = draft_cls(self.draft_hf_config, self.config.hf_config.text)
        # The draft's linears take the target's online scheme.
        prepare_quantization(draft, self.config.quantization)
        self.load_report = load_weights(draft, self.draft_path)
        target_lm = language_model_of(target)
        if self.will_propose:
            draft.share_with_target(target_lm)
            check_shared_embedding(draft)
        else:
            # A producer never embeds a block; the vocabulary must still match.
            draft.validate_target_vocab(target_lm)
        self.model = draft.eval()
        self.own_parameter_bytes = parameter_bytes(draft)
        self.shared_parameter_bytes = draft.shared_parameter_bytes()
        self._arm_aux_capture(target_lm.model)
        self._log_startup()

    @property
    def resident_taps(self) -> list[int]:
        return [t for t in self.tap_ids if t in self.tap_buffers]

    def _arm_aux_capture(self, target_base: nn.Module) -> None:
        self.tap_ids = list(self.model.tap_ids)
        # Non-resident taps (always -1 on a pp > 1 last stage) come via the relay.
        resident = [t for t in self.tap_ids if tap_is_resident(target_base, t)]
        # Tap buffers take the draft's device and the dtype it was built in (a
        # quantized draft's first parameter may hold fp8 codes).
        buffers = allocate_tap_buffers(
            len(resident),
            self.config.max_num_batched_tokens,
            self.model.config.target_hidden_size,
            next(self.model.parameters()).device,
            torch.get_default_dtype(),
        )
        self.tap_buffers = dict(zip(resident, buffers))
        self.capture = TapCapture(target_base, self.tap_buffers)

    def _log_startup(self) -> None:
        trained = getattr(self.model.config, "block_size", None)
        if trained is not None and trained != self.num_speculative_tokens:
            logger.warning(
                "%s was trained on blocks of %d rows; drafting %d per step",
                self.architecture,
                trained,
                self.num_speculative_tokens,
            )
        relayed = [t for t in self.tap_ids if t not in self.resident_taps]
        sharing = (
            "embedding + lm_head shared with the target"
            if self.will_propose
            else "not bound (context-only producer)"
        )
        logger.info(
            "[drafter pp_rank %d tp_rank %d] %s: T=%d, taps %s (resident %s, relayed "
            "%s), mask id %d, markov rank %d, %s, KDA rollback %s; draft parameters "
            "own %.2f MiB, shared %.2f MiB (counted by the target)",
            get_pp_group().rank_in_group,
            get_tp_group().rank_in_group,
            self.architecture,
            self.num_speculative_tokens,
            self.tap_ids,
            self.resident_taps,
            relayed,
            self.model.mask_token_id,
            self.model.config.markov_rank,
            sharing,
            STATE_ROLLBACK_MODE,
            self.own_parameter_bytes / 2**20,
            self.shared_parameter_bytes / 2**20,
        )

    def gather_taps(
        self, num_tokens: int, relayed_taps: dict[int, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """[N, n_taps * H] in tap order: this stage's hooked taps, the rest from
        `relayed_taps` (the relay's `unpack`)."""
        available = {**(relayed_taps or {}), **self.tap_buffers}
        missing = [t for t in self.tap_ids if t not in available]
        if missing:
            raise ValueError(
                f"taps {missing} are neither computed on this stage nor relayed"
            )
        return torch.cat([available[t][:num_tokens] for t in self.tap_ids], dim=-1)

    @torch.inference_mode()
    def precompute_context_kv(
        self,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_tokens: int,
        relayed_taps: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Write draft context rows for the N rows of the target forward just run.

        Call after every target forward on the last stage (prefill chunks that
        sample nothing included), with that forward's positions, slot mapping and
        the taps earlier stages relayed.
        """
        if num_tokens == 0:
            return
        self.model.write_context_kv(
            self.gather_taps(num_tokens, relayed_taps),
            positions[:num_tokens],
            slot_mapping[:num_tokens],
        )

    def capture_graphs(self, sizes: list[int], table_width: int) -> None:
        """Capture the block pass for these batch sizes (CUDA; see block_pass_graphs.py)."""
        self.block_graphs = BlockPassGraphs(
            self.model,
            sizes,
            self.num_speculative_tokens,
            table_width,
            next(self.model.parameters()).device,
        )

    @torch.inference_mode()
    def propose(
        self,
        anchor_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        block_tables: torch.Tensor,
        sampling: SamplingMetadata,
    ) -> DraftOutput:
        """The next T drafts of each sampled sequence, on the device.

        anchor_ids [S] are the tokens just emitted (from the target's vocabulary,
        which the draft shares), anchor_positions [S] the positions they are
        committed at; the drafts are for the next T positions. block_tables [S, W]
        cover each sequence's context rows. `sampling` holds the sequences'
        settings and seeds in the same order.
        """
        if not self.will_propose:
            raise RuntimeError(
                "a context-only producer writes context KV, never drafts"
            )
        num_seqs, width = anchor_ids.shape[0], self.num_speculative_tokens
        if anchor_positions.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
            raise ValueError(
                f"{num_seqs} anchors, {anchor_positions.shape[0]} positions and "
                f"{block_tables.shape[0]} block tables must agree"
            )
        if num_seqs == 0:
            empty = torch.empty(0, width, dtype=torch.long, device=anchor_ids.device)
            return DraftOutput(empty, None)
        replay = None
        if self.block_graphs is not None:
            replay = self.block_graphs.run(anchor_ids, anchor_positions, block_tables)
        if replay is not None and sampling.all_greedy:
            return DraftOutput(replay.greedy, None)
        if replay is not None:
            base_logits = replay.logits
        else:
            base_logits = self.model.block_forward(
                anchor_ids, anchor_positions, block_tables, self.num_speculative_tokens
            )
        return markov_decode(
            base_logits,
            anchor_ids,
            anchor_positions,
            self.model.markov_bias,
            sampling,
        )
