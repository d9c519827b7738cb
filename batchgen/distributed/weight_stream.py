"""Streaming the experts a rank does not hold, layer by layer, for ``data_parallel_offload``
prefill (FlexGen-style; vLLM's prefetch offloader has the same shape).

A bounded buffer of ``num_slots`` layer slots, filled by a background thread:

    streamer.begin_step()              # queue the first num_slots MoE layers
    for each MoE layer L:
        w13, w2 = streamer.acquire(L)  # wait(L): blocks only if the copy is not done yet
        ... compute layer L ...
        streamer.release(L)            # free the slot, queue layer L + num_slots

The host copy is the checkpoint itself, memory-mapped (`MappedSafetensors`): every rank of a
machine maps the same files, so the OS page cache holds one copy per machine whatever the
number of ranks. Copying a layer's experts into a slot also converts them to the model's dtype
and, for the fused CPU kernel, packs them (`batchgen.kernels.fused_moe.pack_expert_weights`'s
layout), so the streaming cost is one pass over the bytes. On CUDA the thread fills pinned
staging buffers and copies them to the slot on a copy stream; events order the copy after the
slot's last use and the layer's compute after the copy (written for GPUs, not yet run on one:
no GPU was available when it was written).

Reported (`stats`): bytes streamed, seconds the thread spent copying, seconds the compute
waited for it (the hidden share is ``1 - wait / copy``), and the peak buffer bytes (the bound:
``num_slots x streamed experts x expert bytes``).
"""

from __future__ import annotations

import json
import mmap
import queue
import re
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from batchgen.kernels.fused_moe import pack_expert_weight_into, packed_expert_shape
from batchgen.models.loader import checkpoint_files, checkpoint_rules
from batchgen.models.model_config import ModelConfig

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


class MappedSafetensors:
    """Read-only, zero-copy tensors over memory-mapped safetensors files.

    The format (huggingface/safetensors, "Format"): an 8-byte little-endian header length N,
    N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the
    data. The safetensors library copies every tensor it returns; streaming wants views of the
    page cache, so the header is read here (a dozen lines) and the views are made with
    ``torch.frombuffer`` on a private (copy-on-write, never written) mapping.
    """

    def __init__(self, files: list[Path]) -> None:
        self._maps: list[mmap.mmap] = []
        self._entries: dict[str, tuple[int, str, list[int], int, int]] = {}
        for file in files:
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps.append(mapping)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                self._entries[name] = (
                    len(self._maps) - 1,
                    info["dtype"],
                    info["shape"],
                    8 + length + begin,
                    end - begin,
                )

    def names(self) -> list[str]:
        return list(self._entries)

    def tensor(self, name: str) -> torch.Tensor:
        """A view of tensor ``name`` (do not write to it).

        Raises:
            KeyError: unknown name; ValueError: a dtype streaming does not handle.
        """
        index, dtype_name, shape, offset, nbytes = self._entries[name]
        dtype = _SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise ValueError(f"cannot stream {name!r} of dtype {dtype_name}")
        raw = torch.frombuffer(self._maps[index], dtype=torch.uint8, count=nbytes, offset=offset)
        if offset % dtype.itemsize:  # unaligned: copy (safetensors aligns data in practice)
            raw = raw.clone()
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        self._entries.clear()
        self._maps.clear()  # the views keep their mapping alive until they are freed


@dataclass
class StreamStats:
    """Streaming counters of one rank (bytes, seconds)."""

    bytes_streamed: int = 0
    layers_streamed: int = 0
    copy_seconds: float = 0.0
    wait_seconds: float = 0.0
    peak_buffer_bytes: int = 0

    @property
    def hidden_share(self) -> float | None:
        """Share of the copy time the compute did not wait for (None before any copy)."""
        if not self.copy_seconds:
            return None
        return max(0.0, 1.0 - self.wait_seconds / self.copy_seconds)


_EXPERT_PARAM = re.compile(r"layers\.(\d+)\.mlp\.(w13|w2)_weight$")


class ExpertWeightStreamer:
    """Copies the ``experts`` (logical ids) of each MoE layer into a bounded set of slots.

    Args:
        path: the checkpoint directory.
        cfg: the model config.
        experts: logical ids of the streamed experts (those this rank does not hold).
        moe_layers: MoE layer indices in execution order.
        dtype / device: of the model.
        packed: fill slots in the fused CPU kernel's packed layout (else ``[E_s, 2I, H]`` and
            ``[E_s, H, I]``).
        num_slots: layers held at once (>= 1).

    Attributes:
        slot_of: ``[E]`` int64, logical expert -> row in the slot buffers (-1: held here).
        stats: `StreamStats`.
    """

    def __init__(
        self,
        path: Path,
        cfg: ModelConfig,
        experts: list[int],
        moe_layers: list[int],
        dtype: torch.dtype,
        device: torch.device,
        packed: bool,
        num_slots: int = 2,
    ) -> None:
        self.cfg, self.experts, self.moe_layers = cfg, list(experts), list(moe_layers)
        self.dtype, self.device, self.packed = dtype, device, packed
        self.num_slots = num_slots
        self.slot_of = torch.full((cfg.num_local_experts,), -1, dtype=torch.long)
        self.slot_of[self.experts] = torch.arange(len(self.experts))
        self.stats = StreamStats()
        self._source = MappedSafetensors(checkpoint_files(path))
        self._sources = self._index_sources()
        self._buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_slots
        self._cuda = device.type == "cuda"
        if self._cuda:  # pinned staging per slot, a copy stream, events (see `_fill`)
            self._staging: list = [None] * num_slots
            self._copy_stream = torch.cuda.Stream(device)
            self._ready = [torch.cuda.Event() for _ in range(num_slots)]
            self._released: list = [None] * num_slots
        self._free = list(range(num_slots))
        self._pending: deque[int] = deque()
        self._inflight: dict[int, tuple[int, threading.Event, list]] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="batchgen-stream", daemon=True)
        self._thread.start()

    # ---- the checkpoint side ------------------------------------------------------------
    def _index_sources(self) -> dict[tuple[int, str, int], list[tuple[str, int | None, int]]]:
        """``(layer, "w13" | "w2", expert)`` -> pieces ``(tensor name, expert index in a fused
        tensor or None, row offset in the destination)``, from the loader's own name rules."""
        rules = checkpoint_rules(self.cfg)
        wanted = set(self.experts)
        sources: dict[tuple[int, str, int], list] = {}
        for name in self._source.names():
            for pattern, fn in rules:
                match = pattern.match(name)
                if match:
                    target = fn(match)
                    break
            else:
                continue
            m = target and _EXPERT_PARAM.search(target.param)
            if not m:
                continue
            layer, which = int(m[1]), m[2]
            if target.expert is not None:
                if target.expert in wanted:
                    key = (layer, which, target.expert)
                    sources.setdefault(key, []).append((name, None, target.row_start or 0))
            else:  # fused [E, ...] tensor
                for e in wanted:
                    sources.setdefault((layer, which, e), []).append((name, e, 0))
        return sources

    def _slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's tensors on the device, allocated on first use."""
        if self._buffers[slot] is None:
            cfg = self.cfg
            h, i2, n = cfg.hidden_size, 2 * cfg.moe_intermediate_size, len(self.experts)
            shapes = (
                (
                    (n, *packed_expert_shape(i2, h, self.dtype)),
                    (n, *packed_expert_shape(h, i2 // 2, self.dtype)),
                )
                if self.packed
                else ((n, i2, h), (n, h, i2 // 2))
            )
            self._buffers[slot] = tuple(
                torch.empty(s, dtype=self.dtype, device=self.device) for s in shapes
            )
            self.stats.peak_buffer_bytes = sum(
                t.numel() * t.element_size() for b in self._buffers if b for t in b
            )
        return self._buffers[slot]

    def _fill(self, layer: int, slot: int) -> int:
        """Copy layer ``layer``'s streamed experts into ``slot``; returns bytes read. On CUDA:
        into the slot's pinned staging buffers, then to the device on the copy stream, after
        the compute stream is done with the slot (its release event); `acquire` makes the
        compute stream wait for the copy (an event, no host synchronisation)."""
        buffers = self._slot(slot)
        if not self._cuda:
            return self._copy_layer(layer, *buffers)
        if self._staging[slot] is None:
            self._staging[slot] = tuple(
                torch.empty(b.shape, dtype=b.dtype, pin_memory=True) for b in buffers
            )
        self._ready[slot].synchronize()  # the previous copy out of this staging is done
        nbytes = self._copy_layer(layer, *self._staging[slot])
        with torch.cuda.stream(self._copy_stream):
            if self._released[slot] is not None:
                self._copy_stream.wait_event(self._released[slot])
            for dst, src in zip(buffers, self._staging[slot], strict=True):
                dst.copy_(src, non_blocking=True)
            self._ready[slot].record(self._copy_stream)
        return nbytes

    def _copy_layer(self, layer: int, w13_buf: torch.Tensor, w2_buf: torch.Tensor) -> int:
        """Layer ``layer``'s streamed experts into host tensors of the slot's shapes."""
        cfg = self.cfg
        h, i2 = cfg.hidden_size, 2 * cfg.moe_intermediate_size
        nbytes = 0
        scratch13 = torch.empty(i2, h, dtype=self.dtype) if self.packed else None
        for j, e in enumerate(self.experts):
            for which, dst_full in (("w13", w13_buf), ("w2", w2_buf)):
                pieces = self._sources.get((layer, which, e))
                if not pieces:
                    raise RuntimeError(f"layer {layer} expert {e}: no {which} in the checkpoint")
                if self.packed:
                    dense = scratch13 if which == "w13" else None
                    if dense is None:
                        src = self._piece(*pieces[0][:2])
                        nbytes += src.numel() * src.element_size()
                        pack_expert_weight_into(dst_full[j], src)
                        continue
                    for name, idx, row in pieces:
                        src = self._piece(name, idx)
                        nbytes += src.numel() * src.element_size()
                        dense[row : row + src.shape[0]].copy_(src)
                    pack_expert_weight_into(dst_full[j], dense)
                else:
                    for name, idx, row in pieces:
                        src = self._piece(name, idx)
                        nbytes += src.numel() * src.element_size()
                        dst_full[j, row : row + src.shape[0]].copy_(src)
        return nbytes

    def _piece(self, name: str, index: int | None) -> torch.Tensor:
        t = self._source.tensor(name)
        return t if index is None else t[index]

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            layer, slot, done, error = job
            t0 = time.perf_counter()
            try:
                with torch.inference_mode():
                    self.stats.bytes_streamed += self._fill(layer, slot)
                self.stats.layers_streamed += 1
            except BaseException as exc:  # handed to the compute thread by `acquire`
                error.append(exc)
            self.stats.copy_seconds += time.perf_counter() - t0
            done.set()

    # ---- the compute side ---------------------------------------------------------------
    def begin_step(self) -> None:
        """Queue this step's MoE layers; the first ``num_slots`` start copying now."""
        if self._inflight or self._pending:
            raise RuntimeError("begin_step while the previous step still holds layers")
        self._pending = deque(self.moe_layers)
        self._schedule()

    def _schedule(self) -> None:
        while self._free and self._pending:
            layer, slot = self._pending.popleft(), self._free.pop()
            done, error = threading.Event(), []
            self._inflight[layer] = (slot, done, error)
            self._jobs.put((layer, slot, done, error))

    def acquire(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The streamed ``(w13, w2)`` of ``layer``, waiting for its copy if needed.

        Raises:
            RuntimeError: ``layer`` was not queued (no `begin_step`, or layers out of order),
                or the copy failed (the cause is chained).
        """
        if layer not in self._inflight:
            raise RuntimeError(f"layer {layer} was not queued for streaming")
        slot, done, error = self._inflight[layer]
        t0 = time.perf_counter()
        done.wait()
        self.stats.wait_seconds += time.perf_counter() - t0
        if error:
            raise RuntimeError(f"streaming layer {layer}'s experts failed") from error[0]
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[slot])
        return self._buffers[slot]

    def release(self, layer: int) -> None:
        """Give ``layer``'s slot back and queue the next layer."""
        slot, done, _ = self._inflight.pop(layer)
        done.wait()
        if self._cuda:  # the next copy into this slot waits for the compute queued so far
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._released[slot] = event
        self._free.append(slot)
        self._schedule()

    def abort_step(self) -> None:
        """Drop whatever this step still holds or has queued (after a failed step)."""
        self._pending.clear()
        for layer in list(self._inflight):
            self.release(layer)
        self._pending.clear()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        self._source.close()
