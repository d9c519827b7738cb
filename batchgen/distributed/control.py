"""The per-step control exchange of an expert-parallel group.

Every rank of the group calls `StepControl.exchange` once per loop iteration, at the same point,
with a few ints (DESIGN.md): its step id, tokens and prefill tokens scheduled, whether it has
unfinished requests, whether it was asked to exit. The all-gathered table decides everything
else the same way on every rank, so the collectives that follow match:

- some rank has tokens: every rank runs the step, a rank without tokens a dummy step (every MoE
  layer's dispatch and combine with zero rows: `StageExecutor.execute_dummy`);
- no rank has tokens: nobody runs layers (ranks wait briefly for requests);
- every rank asked to exit and none has work: all leave the loop together.

This is what keeps a rank with no work from skipping a collective, the hang reported in vLLM
(#43547, #28224) and SGLang (#28915). The exchange runs on the gloo control group, whose timeout
turns a stuck peer into an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

FIELDS = ("step_id", "num_tokens", "num_prefill_tokens", "has_work", "wants_exit")


@dataclass
class StepPlan:
    """The gathered table: one list per field, indexed by rank within the group."""

    step_id: int
    num_tokens: list[int]
    num_prefill_tokens: list[int]
    has_work: list[bool]
    wants_exit: list[bool]

    @property
    def any_tokens(self) -> bool:
        return any(self.num_tokens)

    @property
    def any_work(self) -> bool:
        return any(self.has_work)

    @property
    def done(self) -> bool:
        """Every rank asked to exit and none has work: leave the loop."""
        return all(self.wants_exit) and not self.any_work


class StepControl:
    """One exchange per step over ``group`` (the gloo control group of ``ranks``).

    Raises (from `exchange`): RuntimeError when a peer died (gloo reports the closed
    connection at once), timed out (the group's timeout), or is at another step id (a bug:
    the message names the ranks and their step ids).
    """

    def __init__(self, group, ranks: list[int]) -> None:
        self.group, self.ranks = group, ranks
        self._out = torch.empty(len(ranks) * len(FIELDS), dtype=torch.long)

    def exchange(
        self,
        step_id: int,
        num_tokens: int,
        num_prefill_tokens: int,
        has_work: bool,
        wants_exit: bool,
    ) -> StepPlan:
        mine = torch.tensor(
            [step_id, num_tokens, num_prefill_tokens, int(has_work), int(wants_exit)],
            dtype=torch.long,
        )
        dist.all_gather_single(self._out, mine, group=self.group)
        table = self._out.view(len(self.ranks), len(FIELDS)).tolist()
        steps = [row[0] for row in table]
        if any(s != step_id for s in steps):
            where = ", ".join(f"rank {r}: {s}" for r, s in zip(self.ranks, steps, strict=True))
            raise RuntimeError(f"ranks out of step at the control exchange ({where})")
        return StepPlan(
            step_id,
            [row[1] for row in table],
            [row[2] for row in table],
            [bool(row[3]) for row in table],
            [bool(row[4]) for row in table],
        )
