"""Several choices per request (`n`, `best_of`): each is an engine request of its
own.

The engine runs one sequence per request; a request with n choices becomes n
engine requests over the same prompt (the prefix cache shares its blocks), choice
i seeded with `seed_for_choice(seed, i)` when the request names a seed, so the
choices are independent and each is reproducible.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

from atom.sampling_params import SamplingParams, seed_for_choice


def params_per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The SamplingParams of each of n choices (choice 0 keeps `params`)."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=seed_for_choice(params.seed, i)) for i in range(n)]


def without_output(output: Any) -> Any:
    """A final output with its generated token left out: a request for 0 tokens
    (echo) runs one, as the engine always generates at least one."""
    return replace(
        output,
        output_token_ids=[],
        text="",
        logprobs=None if output.logprobs is None else [],
        finish_reason="length",
    )


def best_of_each(outputs: list[Any], best_of: int, n: int) -> list[Any]:
    """Of each prompt's best_of consecutive outputs, the n of the highest
    cumulative logprob (in that order); all of them when best_of == n."""
    if best_of == n:
        return outputs
    kept = []
    for start in range(0, len(outputs), best_of):
        group = outputs[start : start + best_of]
        group.sort(key=lambda o: sum(lp.logprob for lp in o.logprobs), reverse=True)
        kept.extend(group[:n])
    return kept


async def merged(
    streams: list[AsyncGenerator[Any, None]], firsts: list[Any]
) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, output) as the choices' outputs arrive, starting with the
    first output of each (already awaited); a stream ends with its finished
    output. Closes every stream when done or abandoned."""
    pending: dict[asyncio.Future, int] = {}
    try:
        for index, first in enumerate(firsts):
            yield index, first
            if not first.finished:
                pending[asyncio.ensure_future(anext(streams[index]))] = index
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                output = task.result()
                yield index, output
                if not output.finished:
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        await close_all(streams, list(pending))


async def close_all(
    streams: list[AsyncGenerator[Any, None]], running: list[asyncio.Future]
) -> None:
    """Cancel the `anext` tasks still running on the streams, wait until they have
    stopped (a generator cannot be closed while a task runs it), then close every
    stream (closing a request's stream aborts it)."""
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    for stream in streams:
        await stream.aclose()
