"""The offline engine: requests in, text out.

The engine process is the head of stage 0: it owns the scheduler and the tokenizer,
hands each batch to every rank, and applies each batch's one output message. Up to
pp_size batches are in flight, so every stage has work. Under `skip_tokenizer_init`
there is no tokenizer: prompts are token ids and outputs carry ids and empty text.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import fields, replace
from functools import partial

from tqdm import tqdm

from atom.config import Config
from atom.kv_transfer.connector import (
    KVConnectorScheduler,
    check_remote_prefill_params,
    merge_outputs,
)
from atom.kv_transfer.factory import create_scheduler_connector
from atom.kv_transfer.rank_calls import bootstrap_drafts, load_kv, rank_kv_layout
from atom.kv_transfer.regions import EngineLayout, RankLayout
from atom.model_engine.batch import ScheduledBatch
from atom.model_engine.output_processor import OutputProcessor, RequestOutput
from atom.model_engine.prefill_pacer import PrefillPacer
from atom.model_engine.scheduler import Scheduler
from atom.model_engine.sequence import Sequence
from atom.model_engine.worker import (
    InProcessWorker,
    WorkerGroup,
    refuse_engine_in_rank_process,
)
from atom.sampling_params import SamplingParams
from atom.utils.tokenizer import (
    TEXT_NEEDS_TOKENIZER,
    apply_chat_template,
    engine_tokenizer,
)

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: str = "tiny-kimi-k3", **kwargs) -> None:
        refuse_engine_in_rank_process()
        known = {f.name for f in fields(Config)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(unknown)}")
        self.config = config = Config(model=model, **kwargs)
        self.tokenizer = engine_tokenizer(
            config.model, config.tokenizer, config.skip_tokenizer_init
        )
        self.model_name = model
        self.max_model_len = config.max_model_len
        if config.parallel_config.world_size == 1:
            self.workers = InProcessWorker(config)
        else:
            self.workers = WorkerGroup(config)
        info = self.workers.info
        self.kv_connector = self._kv_connector()
        self.scheduler = Scheduler(
            config.limits,
            info.num_kv_blocks,
            has_recurrent_state=info.has_recurrent_state,
            eos_token_id=self._eos_token_id(),
            connector=self.kv_connector,
            pacer=PrefillPacer(config.scheduler_delay_factor),
        )
        self.outputs = OutputProcessor(self.tokenizer)
        # Seeds of requests that come without one; Config.seed makes them repeatable.
        self.request_seeds = random.Random(config.seed)
        self.in_flight: deque[ScheduledBatch] = deque()
        # A batch per stage in flight; async scheduling keeps the next step queued
        # on the one device while the host finishes the current one (run_ahead.py).
        self.max_in_flight = (
            2 if config.async_scheduling else config.pipeline_parallel_size
        )
        logger.info(
            "engine ready: %s, tp=%d pp=%d, %d KV blocks of %d tokens, "
            "speculation %s, %s",
            model,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            info.num_kv_blocks,
            config.block_size,
            config.speculative_config.method if config.speculative_config else "off",
            config.describe_settings(),
        )

    def _kv_connector(self) -> KVConnectorScheduler | None:
        """P/D: the scheduler side, told every rank's registered regions."""
        transfer = self.config.kv_transfer
        if transfer is None:
            return None
        connector = create_scheduler_connector(transfer)
        ranks = [RankLayout.from_dict(d) for d in self.workers.call(rank_kv_layout)]
        connector.local_layout = EngineLayout(
            self.config.block_size,
            self.config.tensor_parallel_size,
            self.config.pipeline_parallel_size,
            ranks,
        )
        logger.info(
            "P/D %s over %s (%s), layout %s",
            transfer.kv_role,
            transfer.kv_connector,
            transfer.protocol,
            connector.local_layout.fingerprint()[:16],
        )
        return connector

    def kv_transfer_info(self) -> dict:
        """`GET /kv_transfer_info`: the role, the topology and, for a consumer's
        handshake, every rank's regions."""
        config = self.config
        info = {
            "kv_role": config.kv_role,
            "tp_size": config.tensor_parallel_size,
            "pp_size": config.pipeline_parallel_size,
            "dp_size": 1,
            # Producer: finished requests whose blocks wait for a consumer;
            # consumer: requests waiting for their KV.
            "held_transfers": len(self.scheduler.held),
            "parked_requests": len(self.scheduler.parked),
        }
        if self.kv_connector is not None:
            info["kv_connector"] = config.kv_transfer.kv_connector
            info["layout"] = self.kv_connector.local_layout.to_dict()
        return info

    def release_kv_transfer(self, transfer_id: int) -> bool:
        """The consumer has the blocks of `transfer_id` (or gave up): free them."""
        return self.scheduler.release_transfer(transfer_id)

    def _receive_kv(self) -> list[RequestOutput]:
        """Consumer: receive every parked request's KV while no batch is in flight
        (the ranks answer calls in order); producer: end overdue leases."""
        self.scheduler.expire_leases(time.monotonic())
        if not self.scheduler.parked or self.in_flight:
            return []
        meta = self.kv_connector.build_connector_meta()
        reports = self.workers.call(partial(load_kv, meta)) if meta.reqs_to_recv else []
        result = merge_outputs(reports, {req.seq_id for req in meta.reqs_to_recv})
        result.failed_recving.update(self.kv_connector.take_failures())
        received = self.scheduler.finish_receives(result)
        self._bootstrap_drafts([seq for seq in received if not seq.is_finished])
        return [
            self._output_of(self.outputs.request_of_seq[seq.seq_id])
            for seq in received
            if seq.seq_id in self.outputs.request_of_seq
        ]

    def _bootstrap_drafts(self, seqs: list[Sequence]) -> None:
        """Received requests start decoding with the drafts the aggregated engine
        would have proposed after their prefill, so acceptance matches it."""
        if not seqs or self.config.speculative_config is None:
            return
        works = self.scheduler.bootstrap_works(seqs)
        anchors = [seq.last_token for seq in seqs]
        replies = self.workers.call(partial(bootstrap_drafts, works, anchors))
        drafts = next(reply for reply in replies if reply is not None)
        for seq, ids in zip(seqs, drafts):
            seq.spec_token_ids = ids

    def _eos_token_id(self) -> int | list[int] | None:
        hf = self.config.hf_config
        eos = hf.get("eos_token_id", hf.text.get("eos_token_id"))
        if eos is None and self.tokenizer is not None:
            return self.tokenizer.eos_token_id
        return eos

    # ---- requests ----
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        kv_transfer_params: dict | None = None,
        final_only: bool = False,
    ) -> str:
        """Queue one request; its id. With `final_only`, `step` returns its output
        only once it finishes: its text is decoded then, not step by step."""
        params = sampling_params or SamplingParams()
        if kv_transfer_params is not None and self.kv_connector is None:
            raise ValueError(
                "kv_transfer_params given, but this engine runs without "
                "--kv-transfer-config"
            )
        if self.tokenizer is None:
            self._check_tokenizer_free(prompt, params)
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.config.hf_config.text.get("vocab_size")
        if vocab is not None and any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if kv_transfer_params is not None:
            check_remote_prefill_params(kv_transfer_params, vocab)
        named = [
            t for t in params.token_ids_to_check if vocab is not None and t >= vocab
        ]
        if named:
            raise ValueError(
                f"logit_bias / stop_token_ids name token ids {named[:5]} outside "
                f"the vocabulary [0, {vocab})"
            )
        self._check_fits_context(len(token_ids), params.max_tokens)
        if params.seed is None:
            # Sampling draws from uniforms keyed by the request's seed, so every
            # request needs one; the caller's object is left as it was.
            seed = self.request_seeds.getrandbits(63)
            params = replace(params, seed=seed)
        seq = Sequence(
            token_ids, params, request_id, kv_transfer_params=kv_transfer_params
        )
        self.scheduler.add(seq)
        try:
            self.outputs.add(seq, final_only)
        except BaseException:
            self.scheduler.abort(seq.request_id)  # no half-added request runs on
            raise
        return seq.request_id

    def _check_fits_context(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request whose prompt and max_tokens together pass max_model_len.

        The one place for this rule (the server and the CLI reach it through
        add_request): asking for more than fits is an error, as in the OpenAI API,
        never silently cut to what is left of the context.
        """
        total = prompt_tokens + max_tokens
        if total <= self.max_model_len:
            return
        room = self.max_model_len - prompt_tokens
        remedy = (
            f"ask for at most {room} tokens or shorten the prompt"
            if room > 0
            else f"shorten the prompt to fewer than {self.max_model_len} tokens"
        )
        raise ValueError(
            f"prompt of {prompt_tokens} tokens + max_tokens={max_tokens} = {total} "
            f"tokens exceeds max_model_len={self.max_model_len}: {remedy}"
        )

    @staticmethod
    def _check_tokenizer_free(prompt: str | list[int], params: SamplingParams) -> None:
        if isinstance(prompt, str):
            raise ValueError(TEXT_NEEDS_TOKENIZER)
        if params.stop:
            raise ValueError(
                "stop strings need a tokenizer, and this engine runs with "
                "--skip-tokenizer-init (skip_tokenizer_init=True): drop stop and end "
                "on eos or max_tokens"
            )

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.outputs.drop(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.in_flight) or not self.scheduler.is_finished()

    # ---- stepping ----
    def step(self) -> list[RequestOutput]:
        received = self._receive_kv() if self.kv_connector is not None else []
        while len(self.in_flight) < self.max_in_flight:
            if self.scheduler.parked and self.in_flight:
                break  # drain the pipeline so the parked requests can receive
            batch = self.scheduler.schedule()
            if batch is None:
                break
            self.workers.submit(batch)
            if batch.produces_output:
                self.in_flight.append(batch)
            else:
                self.scheduler.postprocess(batch, None)
        if not self.in_flight:
            return received
        batch = self.in_flight.popleft()
        self.scheduler.postprocess(batch, self.workers.receive_output())
        results = received
        for work in batch.work:
            request_id = self.outputs.request_of_seq.get(work.seq_id)
            if (
                work.sample
                and request_id is not None
                and self.outputs.wants_output(request_id)
            ):
                results.append(self._output_of(request_id))
        return results

    def _output_of(self, request_id: str) -> RequestOutput:
        """The request's output after a step. Detokenizing and stop strings concern
        this request only, so a failure there finishes it with `error` set."""
        try:
            output, hit_stop = self.outputs.update(request_id)
        except Exception as error:
            logger.exception("request %s failed after a step", request_id)
            self.scheduler.abort(request_id, "error")
            return self.outputs.fail(request_id, f"{type(error).__name__}: {error}")
        if hit_stop:
            self.scheduler.abort(request_id, "stop")
        return output

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[dict]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts but {len(sampling_params)} sampling params"
            )
        start = time.monotonic()
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                # Only finished outputs are read here: no text step by step.
                ids.append(self.add_request(prompt, params, final_only=True))
        except Exception:
            # One bad prompt refuses the whole call: no orphan keeps generating.
            for request_id in ids:
                self.abort_request(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(done) < len(ids):
            for out in self.step():
                if out.error is not None:
                    for request_id in ids:
                        self.abort_request(request_id)
                    raise RuntimeError(f"request {out.request_id}: {out.error}")
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        elapsed = time.monotonic() - start
        return [
            {
                "text": done[r].text,
                "token_ids": done[r].output_token_ids,
                # TokenLogprob per output token with SamplingParams.logprobs, else None.
                "logprobs": done[r].logprobs,
                # With SamplingParams.prompt_logprobs: per prompt token, the first None.
                "prompt_logprobs": done[r].prompt_logprobs,
                "finish_reason": done[r].finish_reason,
                "num_tokens_input": len(done[r].prompt_token_ids),
                "num_tokens_output": len(done[r].output_token_ids),
                "latency": elapsed,
            }
            for r in ids
        ]

    # ---- statistics ----
    def get_stats(self) -> dict:
        return self.scheduler.stats()

    def get_spec_decode_stats(self) -> dict | None:
        """Cumulative speculative-decoding counters (None without speculation)."""
        stats = self.scheduler.spec_stats
        return stats.as_dict() if stats is not None else None

    # ATOM's name for the same counters.
    get_mtp_statistics = get_spec_decode_stats

    def format_mtp_stats_line(self) -> str | None:
        stats = self.scheduler.spec_stats
        return stats.format_line() if stats is not None else None

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.tokenizer is None:
            raise ValueError(
                "chat messages need a tokenizer, and this engine runs with "
                "--skip-tokenizer-init (skip_tokenizer_init=True): send token-id "
                "prompts to the completions API"
            )
        return apply_chat_template(self.tokenizer, messages)

    def close(self) -> None:
        self.workers.close()

    def __del__(self) -> None:
        workers = getattr(self, "workers", None)
        if workers is not None:
            workers.close()
