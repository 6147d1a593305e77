"""What a batch does when its forward raises (docs/RELIABILITY.md, "Faults").

Policy: a batch of several calls whose forward raises is run again one call at a time, so
that only the calls that fail alone get an error and the rest get their answers. Session
steps are rolled back before the retry (Sessions.run_steps), so a retried step is written
to the cache once. A device out-of-memory answers that request RESOURCE_EXHAUSTED (retry
later, or send less); anything else is a bug and answers INTERNAL, logged once per batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mha_serve.engine.errors import TooLarge

log = logging.getLogger(__name__)
T = TypeVar("T")


class DeviceOutOfMemory(TooLarge):
    """The device ran out of memory computing this request (RESOURCE_EXHAUSTED)."""


def isolate_failures(
    run_batch: Callable[[list[Any]], list[Any]],
) -> Callable[[list[Any]], list[Any]]:
    """run_batch(calls) whose failure is each failing call's own: on an error, every call
    of the batch runs alone, and each gets its own result or error."""

    def run(calls: list[Any]) -> list[Any]:
        try:
            return run_batch(calls)
        except Exception as e:
            if len(calls) == 1:
                return [_answer(e)]
            _free_device_memory(e)
            log.warning(
                "a batch of %d calls failed (%s: %s); running each alone",
                len(calls),
                type(e).__name__,
                e,
                exc_info=not isinstance(e, torch.OutOfMemoryError),
            )
        results: list[Any] = []
        for call in calls:
            try:
                results.extend(run_batch([call]))
            except Exception as e:
                _free_device_memory(e)
                results.append(_answer(e))
        return results

    return run


def out_of_memory_is_exhausted(run_one: Callable[..., T]) -> Callable[..., T]:
    """run_one(*call) whose device out-of-memory is the request's RESOURCE_EXHAUSTED."""

    def run(*call: Any) -> T:
        try:
            return run_one(*call)
        except torch.OutOfMemoryError as e:
            _free_device_memory(e)
            raise _answer(e) from e

    return run


def _answer(error: Exception) -> Exception:
    if isinstance(error, torch.OutOfMemoryError):
        return DeviceOutOfMemory(
            f"the device ran out of memory computing this request ({error}); retry later, "
            "or send fewer sequences, shorter ones, or no attention weights"
        )
    return error


def _free_device_memory(error: Exception) -> None:
    """After an out-of-memory on CUDA, hand the cached blocks back before running again."""
    if isinstance(error, torch.OutOfMemoryError) and torch.cuda.is_available():
        torch.cuda.empty_cache()
