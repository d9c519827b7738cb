"""``--help`` says each flag's default: ``batchgen bench``'s own flags (``--device``,
``--modes`` and ``--workloads`` said none) and every flag made from an `EngineConfig` /
`ParallelConfig` field (``--straggler-rebalance-interval-steps`` said none: unset)."""

from __future__ import annotations

import argparse

import pytest

from batchgen.bench.args import DEFAULT_WORKLOADS, MODES
from batchgen.config import EngineConfig, ParallelConfig
from batchgen.entrypoints import cli


def _help(subcommand: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens: one line per flag
    with pytest.raises(SystemExit) as info:
        cli.main([subcommand, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_bench_help_states_the_defaults(capsys, monkeypatch):
    text = _help("bench", capsys, monkeypatch)
    assert "--device {auto,cpu,cuda} default: auto (cuda when there is one)" in text
    assert (
        "--modes MODES comma-separated subset of hf_generate, hf_generate_batch, lockstep, "
        "coalesce (default: all four)"
    ) in text
    assert (
        "(default: rollouts,extraction,search,extraction-json: shared-docs and tree-search run "
        "only when named)"
    ) in text
    assert "--straggler-rebalance-interval-steps N every this many steps" in text
    assert "by recompute; docs/distributed.md); unset: no rebalancing (default: unset)" in text
    assert "4 layers (default: mixtral)" in text


def test_bench_defaults_in_the_help_are_the_real_ones():
    from batchgen.bench.args import BENCH_DEFAULTS
    from batchgen.bench.workloads import make_workloads

    args = _subparser("bench").parse_args([])
    assert args.modes == ",".join(MODES) and args.workloads is None
    assert BENCH_DEFAULTS["device"] == "auto" and args.arch == "mixtral"
    # Without --workloads: make_workloads' three, and extraction-json (runner.run).
    names = [w.name for w in make_workloads(512, quick=True)]
    assert [*names, "extraction-json"] == list(DEFAULT_WORKLOADS)


@pytest.mark.parametrize("subcommand", ["run", "serve", "bench"])
def test_every_flag_that_takes_a_value_states_its_default(subcommand):
    fields = set(EngineConfig.field_names() + ParallelConfig.field_names())
    unstated = []
    for action in _subparser(subcommand)._actions:
        takes_value = action.nargs != 0 and action.option_strings
        exempt = action.required or action.dest in ("config", "help")
        if action.dest in fields or (subcommand == "bench" and takes_value and not exempt):
            if "default" not in (action.help or "").lower():
                unstated.append(action.option_strings[-1])
    assert unstated == []
