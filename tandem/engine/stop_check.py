"""Which steps the device thread may skip: on a CPU, a step of a few decodes whose requests all
ended on a stop id in the step before it (`execution.batch.StopCheck`, read by the device thread
once that step's tokens are in hand). Only stop ids are checked: those end the request on the
host too, so a skipped step never held a token the host needs."""

from __future__ import annotations

from tandem.execution.batch import StopCheck
from tandem.scheduling.scheduler import ScheduledBatch, Scheduler

# A step of more requests than this is not checked before it runs: they rarely all stop at once.
STOP_CHECK_MAX_REQUESTS = 8


def stop_check(
    batch: ScheduledBatch, previous: ScheduledBatch, logprobs: object | None, eos_ids: set[int]
) -> StopCheck | None:
    """The check that skips `batch` if each of its requests stops in `previous`, the step before
    it: only for a few decodes, all of them in that step, whose output holds nothing but ids
    (`logprobs`, how to read that step's logprobs: None where it has none); None otherwise."""
    if (
        logprobs is not None
        or len(batch.items) > STOP_CHECK_MAX_REQUESTS
        or batch.num_decodes != len(batch.items)
    ):
        return None
    before = previous.sampled
    index = {id(item.request): j for j, item in enumerate(before)}
    items = [index.get(id(item.request)) for item in batch.items]
    if None in items:
        return None
    return StopCheck(
        previous_rows=tuple(item.num_rows for item in before),
        previous_verify=tuple(item.verify for item in before),
        items=tuple(items),
        stop_ids=tuple(
            frozenset(p.stop_token_ids).union(() if p.ignore_eos else eos_ids)
            for p in (item.request.params for item in batch.items)
        ),
    )


def retire_skipped(batch: ScheduledBatch, scheduler: Scheduler) -> None:
    """Retire a step the device skipped, which must hold no request the host still runs: its
    tokens would be lost, so the check and the host disagreeing stops the engine here."""
    running = [it.request.request_id for it in batch.sampled if not it.request.finished]
    if running:
        raise RuntimeError(f"step {batch.step_id} was skipped with {running} running")
    scheduler.retire_step(batch)
    for item in batch.sampled:
        scheduler.settle(item, 0)
