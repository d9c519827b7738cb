"""Host staging of the per-step inputs: Python lists -> device tensors without a host sync.

Every step the model runner turns Python lists (token ids, positions, slot mapping, block
tables, context lengths, sample indices, KV block copy lists) into device tensors. On CUDA,
``torch.tensor(values, device="cuda")`` copies from pageable host memory, and a copy from
pageable memory makes the host wait for the stream before it starts (CUDA runtime API,
"API synchronization behavior": pageable host-to-device copies synchronise): one hidden host
sync per field per step. vLLM's answer (``CpuGpuBuffer`` in ``vllm/v1/utils.py``, used by
``gpu_model_runner.py`` / ``gpu_input_batch.py``): per-field pinned CPU buffers with a numpy
view, filled from the lists, sent with ``non_blocking=True``. This module does the same:

- one *slot* per field use: a pinned CPU buffer (grown geometrically, at least doubling, so a
  step size seen once costs one allocation) with its numpy view and a CUDA event;
- `HostStaging.to_device` fills the first free slot of the field through numpy, copies its
  first ``numel`` elements into a fresh device tensor with ``non_blocking=True``, and records
  the slot's event after the copy;
- a slot is free when its event has completed (``event.query()``): its last copy has left the
  pinned memory. Several uses of one field in one step (the micro-batches of a ``coalesce``
  step, the decode buckets of the torch path) each take a slot, so a field has as many slots
  as its most uses in one step; since every step ends by reading the sampled tokens (which
  waits for the stream), all slots are free at the next step and refilling never waits. Where
  no slot is free a new one is made (never a wait). That is vLLM's event discipline
  (``synchronize_input_prep``: wait on the event recorded after the last copies before
  refilling) without its wait, at the cost of a slot per concurrent use: a handful of KiB.
- unlike ``CpuGpuBuffer`` there is no persistent device twin: each use copies into a fresh
  device tensor from the caching allocator, because the micro-batches of one step hold their
  tensors at the same time (and CUDA graphs copy into their own static buffers).

On CPU the engine does not stage: `to_device` is ``torch.tensor(values)`` as before, no copy,
no behaviour change. Tests force staging on CPU (``staged=True``, ``pin_memory=False``, a
stand-in event) to check the buffers' values, dtypes, views and growth (tests/test_host_staging.py).
Pinned memory and the events run only on CUDA: never yet on a GPU (docs/gpu.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

_MIN_CAPACITY = 256  # elements: a step's smallest buffers in one allocation


@dataclass
class _Slot:
    """One pinned host buffer of a field: ``host [capacity]``, its numpy view, and the event
    recorded after its last copy to the device (None before the first)."""

    host: torch.Tensor
    array: np.ndarray
    event: object | None = None


class HostStaging:
    """Per-field host buffers for the tensors a step copies to the device (module docstring).

    Args:
        device: where the tensors go.
        staged: stage through host buffers (default: on CUDA only); False is
            ``torch.tensor(values, device=device)``.
        pin_memory: page-lock the host buffers (default: when staged on CUDA).
        event_factory: makes the per-slot event (``record()``, ``query()``); default
            ``torch.cuda.Event`` on CUDA, else None (a copy on CPU is done when it returns).
    Attributes:
        num_allocations: host buffers allocated so far (growth and new slots), for tests and
            the start-up log.
    """

    def __init__(
        self,
        device: torch.device,
        staged: bool | None = None,
        pin_memory: bool | None = None,
        event_factory: Callable[[], object] | None = None,
    ) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.staged = cuda if staged is None else staged
        self.pin_memory = (self.staged and cuda) if pin_memory is None else pin_memory
        if event_factory is None and cuda:
            event_factory = torch.cuda.Event
        self.event_factory = event_factory
        self.slots: dict[tuple[str, torch.dtype], list[_Slot]] = {}
        self.num_allocations = 0

    def to_device(
        self, field: str, values: Sequence[int], dtype: torch.dtype = torch.long
    ) -> torch.Tensor:
        """``values`` (Python ints) as a ``[len(values)]`` tensor of ``dtype`` on the device.

        Raises:
            ValueError: ``field`` empty, or ``dtype`` without a numpy equivalent.
        """
        if not self.staged:
            return torch.tensor(values, dtype=dtype, device=self.device)
        n = len(values)
        slot = self._slot(field, dtype, n)
        if n:
            slot.array[:n] = values
        return self._send(slot, (n,))

    def array_to_device(self, field: str, array: np.ndarray) -> torch.Tensor:
        """A 1-D or 2-D numpy ``array`` as a tensor of its shape on the device: on CPU
        unstaged, the array itself (``torch.from_numpy``; the caller must not reuse it), else
        through the field's host slot like `to_device`. Only int64 and int32 arrays are
        staged (``torch.long`` / ``torch.int32``).

        Raises:
            ValueError: ``field`` empty, or an array that is neither int64 nor int32.
        """
        if array.dtype not in (np.int64, np.int32):
            raise ValueError(f"{field}: int64 or int32 array expected, got {array.dtype}")
        if not self.staged:
            return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
        dtype = torch.long if array.dtype == np.int64 else torch.int32
        slot = self._slot(field, dtype, array.size)
        if array.size:
            slot.array[: array.size].reshape(array.shape)[...] = array
        return self._send(slot, array.shape)

    def rows_to_device(
        self,
        field: str,
        rows: Sequence[Sequence[int]],
        width: int,
        pad: int = 0,
        dtype: torch.dtype = torch.long,
    ) -> torch.Tensor:
        """``rows`` (each at most ``width`` ints) padded with ``pad`` to ``[len(rows), width]``
        of ``dtype`` on the device (a block table).

        Raises:
            ValueError: a row longer than ``width`` (naming ``field``).
        """
        if any(len(r) > width for r in rows):
            raise ValueError(f"{field}: a row is longer than the width {width}")
        if not self.staged:
            padded = [list(r) + [pad] * (width - len(r)) for r in rows]
            return torch.tensor(padded, dtype=dtype, device=self.device).view(len(rows), width)
        b = len(rows)
        slot = self._slot(field, dtype, b * width)
        table = slot.array[: b * width].reshape(b, width)
        table.fill(pad)
        for i, r in enumerate(rows):
            table[i, : len(r)] = r
        return self._send(slot, (b, width))

    def _slot(self, field: str, dtype: torch.dtype, numel: int) -> _Slot:
        """A free slot of ``(field, dtype)`` holding at least ``numel`` elements: the first
        whose last copy has completed, grown if too small, or a new one."""
        if not field:
            raise ValueError("field must be a non-empty name")
        slots = self.slots.setdefault((field, dtype), [])
        for i, slot in enumerate(slots):
            if slot.event is None or slot.event.query():
                if slot.host.numel() < numel:
                    slots[i] = slot = self._new_slot(dtype, max(numel, 2 * slot.host.numel()))
                return slot
        slots.append(self._new_slot(dtype, numel))
        return slots[-1]

    def _new_slot(self, dtype: torch.dtype, numel: int) -> _Slot:
        capacity = max(_MIN_CAPACITY, 1 << max(numel - 1, 0).bit_length())  # a power of two
        host = torch.empty(capacity, dtype=dtype, pin_memory=self.pin_memory)
        try:
            array = host.numpy()
        except TypeError as exc:  # e.g. bfloat16
            raise ValueError(f"dtype {dtype} cannot be staged through numpy") from exc
        self.num_allocations += 1
        return _Slot(host, array)

    def _send(self, slot: _Slot, shape: tuple[int, ...]) -> torch.Tensor:
        """The first ``prod(shape)`` elements of ``slot`` copied into a new device tensor
        (asynchronously from pinned memory on CUDA); the slot's event marks the copy's end."""
        numel = math.prod(shape)
        out = torch.empty(shape, dtype=slot.host.dtype, device=self.device)
        out.copy_(slot.host[:numel].view(shape), non_blocking=self.pin_memory)
        if self.event_factory is not None:
            slot.event = slot.event or self.event_factory()
            slot.event.record()
        return out
