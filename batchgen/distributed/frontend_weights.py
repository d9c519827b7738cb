"""Weight updates and prefix-cache resets for a data-parallel job (RL rollouts on several
ranks: the policy changes between `generate` calls, the rank processes stay).

    llm = LLM(path, data_parallel_size=2, enable_expert_parallel=True)
    llm.generate(prompts, params)
    llm.update_weights(trainer.state_dict())   # every rank, its own shard of the experts
    llm.generate(prompts, params)              # the new policy everywhere

`FrontendWeights` is a mixin of `batchgen.distributed.frontend.DPEngineClient`. An update is
one `UpdateWeights` message to every rank: a checkpoint directory's path (every rank reads it
itself, an expert-parallel rank only its experts), or the tensors serialised with
`safetensors.torch.save` (bytes, so that ranks on other machines get them too; pickled tensors
would travel as shared-memory handles). Each rank applies it with
`batchgen.engine.weight_update.update_weights` and answers; the call returns when every rank
has. The ranks check names and shapes before copying anything, and they all check the same
tensors, so a bad update fails on every rank with the same `ValueError` and changes nothing.

A rank started again after a failure (elastic recovery) loads the checkpoint the job started
on, then applies the updates made since, in order (`Setup.weight_updates`), before it is
ready: it never serves old weights. The job keeps those updates: path updates as paths, tensor
updates as bytes, an update dropped once a later tensor update names every tensor it did; a job
whose trainer sends the whole model each step keeps about one model's bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

import torch
from safetensors.torch import save as save_safetensors

from batchgen.distributed.frontend_recovery import locked
from batchgen.distributed import protocol as msg
from batchgen.distributed.rank_set import RankFailedError
from batchgen.engine.weight_update import WeightsLike, check_unique_name, check_update_tensor

_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError}


class FrontendWeights:
    """`LLM.update_weights` and `LLM.reset_prefix_cache` for a data-parallel job (see the module
    docstring)."""

    @locked
    def update_weights(self, weights: WeightsLike) -> int:
        """Replace weights on every rank; returns the number of distinct checkpoint tensors
        copied (by at least one rank: an expert-parallel rank copies only its experts).

        Args:
            weights: as `batchgen.engine.weight_update.update_weights` (a state dict or
                ``(name, tensor)`` pairs, or a safetensors checkpoint directory every rank can
                read at that path).
        Raises:
            RuntimeError: requests are in flight, or the ranks disagreed (some applied the
                update and some raised: the job's weights are no longer the same everywhere).
            ValueError, TypeError: a bad update (every rank refused it; nothing changed).
            NotImplementedError: ``prefill_strategy='data_parallel_offload'`` (ranks stream
                the experts they do not hold from the files they started on).
            RankFailedError: a rank failed and could not be recovered.
        """
        self._check_idle("update_weights")
        ep = self.parallel.resolved_expert_parallel_size
        if self.parallel.prefill_strategy == "data_parallel_offload" and ep > 1:
            raise NotImplementedError(
                "update_weights with prefill_strategy 'data_parallel_offload': ranks stream the "
                "experts they do not hold from the checkpoint files they started on, which the "
                "update does not change; use prefill_strategy 'expert_parallel'"
            )
        if isinstance(weights, (str, os.PathLike)):
            update, names = msg.UpdateWeights(-1, path=os.path.abspath(weights)), None
        else:
            data, names = _serialise(weights)
            update = msg.UpdateWeights(-1, data=data)
        updates = self.rank_set.weight_updates
        updates.append(update)  # a rank started again during the call applies it too
        try:
            replies = self._call(lambda token: msg.UpdateWeights(token, update.path, update.data))
        except BaseException:
            _forget(updates, update)
            raise
        failed = [r for r in replies if r.error is not None]
        if failed:
            _forget(updates, update)
            first = failed[0]
            if len(failed) < len(replies):
                raise RuntimeError(
                    f"update_weights: ranks {[r.rank for r in failed]} refused the update "
                    f"({first.error_type}: {first.error}) while the others applied it; the "
                    "ranks' weights now differ: update again or start a new LLM"
                )
            raise _ERRORS.get(first.error_type, RuntimeError)(first.error)
        if names is not None:
            self._drop_covered(update, names)
        return len(set().union(*(r.result for r in replies)))

    @locked
    def reset_prefix_cache(self) -> bool:
        """Drop every rank's cached prefixes (vLLM's name); False while requests are in flight
        (on any rank). `update_weights` does this itself."""
        if self.has_unfinished_requests():
            return False
        return all(r.result for r in self._call(msg.ResetPrefixCache))

    def _check_idle(self, what: str) -> None:
        self._check_open()
        if self.has_unfinished_requests():
            raise RuntimeError(
                f"{what}: {self.get_num_unfinished_requests()} requests are in flight; "
                "update the weights between generate calls (finish or abort them first)"
            )

    def _call(self, make: Callable[[int], object]) -> list[msg.Reply]:
        """Send ``make(token)`` to every rank and wait for each one's `Reply`. Ranks started
        again after a failure are waited for first (they must not miss the message); a failure
        during the call is recovered and the call made again (both messages are idempotent)."""
        while True:
            self._check_open()
            token = None
            try:
                while self.rank_set.joining:
                    self._dispatch(self.rank_set.receive(1.0))
                token = next(self._answer_token)
                self.rank_set.broadcast(make(token))
                keys = [(token, r.rank) for r in self._ranks if not r.retired]
                while any(k not in self._answers for k in keys):
                    self._dispatch(self.rank_set.receive(1.0))
            except RankFailedError as failure:
                for key in [k for k in self._answers if k[0] == token]:
                    del self._answers[key]  # the survivors' answers to the send made again
                self._recover(failure)
                continue
            return [self._answers.pop(k) for k in keys]

    def _drop_covered(self, update: msg.UpdateWeights, names: frozenset[str]) -> None:
        """Forget earlier tensor updates whose every tensor ``update`` (named ``names``)
        replaces: replaying them before it would change nothing."""
        covered = getattr(self, "_update_names", {})
        self._update_names = covered
        kept = []
        for old in self.rank_set.weight_updates:
            if old is not update and id(old) in covered and covered[id(old)] <= names:
                covered.pop(id(old), None)
                continue
            kept.append(old)
        covered[id(update)] = names
        self.rank_set.weight_updates[:] = kept


def _forget(updates: list[msg.UpdateWeights], update: msg.UpdateWeights) -> None:
    """Remove ``update`` itself from the replay list (not `list.remove`: dataclasses compare
    by value, and an earlier, applied update of the same path or bytes must stay)."""
    updates[:] = [u for u in updates if u is not update]


def _serialise(
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> tuple[bytes, frozenset[str]]:
    """``weights`` as safetensors bytes (CPU, contiguous; tensors sharing storage, such as tied
    embeddings, copied apart as the format requires) and their names.

    Raises:
        TypeError: a value that is not a tensor.
        ValueError: a tensor on the meta device, or a name given twice.
    """
    items = weights.items() if isinstance(weights, Mapping) else weights
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    seen: set[str] = set()
    for name, tensor in items:
        check_unique_name(name, seen)
        check_update_tensor(name, tensor)
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[str(name)] = t
    return save_safetensors(tensors), frozenset(tensors)
