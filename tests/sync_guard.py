"""A guard for tests: patch the tensor methods and torch functions that synchronise with the
host to raise `HostSync` when BatchGen code calls them (tests/test_cuda_graphs.py,
tests/test_step_host_syncs.py)."""

from __future__ import annotations

import sys

import torch


class HostSync(AssertionError):
    pass


def no_host_sync_from_batchgen(monkeypatch):
    """Patch the tensor methods and torch functions that synchronise with the host (or copy
    host data in) to raise when BatchGen code calls them (the Triton interpreter's own host
    copies are allowed). Not caught: syncs inside torch (boolean-mask indexing, CPU fallbacks)."""
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
                 "numpy", "nonzero"):  # fmt: skip
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _name=name, _original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "/batchgen/" in caller.replace("\\", "/"):
                raise HostSync(f"Tensor.{_name} called from {caller}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    # torch.nonzero syncs; torch.tensor / as_tensor from host data is a host-to-device copy
    # that a CUDA graph cannot capture (and would replay stale).
    for name in ("nonzero", "tensor", "as_tensor", "from_numpy"):
        original = getattr(torch, name)

        def guarded_fn(*args, _name=name, _original=original, **kwargs):
            if "/batchgen/" in sys._getframe(1).f_code.co_filename:
                raise HostSync(f"torch.{_name} called from batchgen")
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch, name, guarded_fn)
    # an explicit wait for the device (the executor's old stage clock did this per stage)
    original_sync = torch.cuda.synchronize

    def guarded_sync(*args, **kwargs):
        if "/batchgen/" in sys._getframe(1).f_code.co_filename:
            raise HostSync("torch.cuda.synchronize called from batchgen")
        return original_sync(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "synchronize", guarded_sync)
