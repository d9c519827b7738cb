"""The default model's name as a model: ``batchgen/default-mixtral-v1`` (the name results and
/v1/models carry) and ``default-mixtral-v1`` (its folder's name) run the default model, the
same as no model given; a local directory of that name still wins, other names keep their
error. The default model is a tiny checkpoint here (`default_model_path` patched)."""

from __future__ import annotations

import logging

import pytest

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig
from batchgen.entrypoints import cli
from batchgen.models import default_model
from batchgen.models.default_model import DEFAULT_MODEL_ID, RANDOM_WEIGHTS_NOTE

NAMES = [DEFAULT_MODEL_ID, "default-mixtral-v1"]


@pytest.fixture
def tiny_default(monkeypatch, checkpoint_dir) -> str:
    path = str(checkpoint_dir("mixtral"))
    monkeypatch.setattr(default_model, "default_model_path", lambda: path)
    return path


def _tokens(llm: LLM) -> list[int]:
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("name", NAMES)
def test_the_default_models_name_runs_the_default_model(tiny_default, caplog, name):
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=name)
    assert llm.llm_engine.model_name == DEFAULT_MODEL_ID  # as without a model
    assert llm.llm_engine.config.model == tiny_default
    assert RANDOM_WEIGHTS_NOTE in caplog.text
    assert _tokens(llm) == _tokens(LLM())


@pytest.mark.parametrize("command", ["run", "serve"])
def test_the_cli_passes_the_name_as_no_model(command):
    extra = ["-i", "in.jsonl", "-o", "out.jsonl"] if command == "run" else []
    args = cli.build_parser().parse_args([command, *extra, "--model", DEFAULT_MODEL_ID])
    kwargs = cli.engine_kwargs(args)
    assert kwargs["model"] == DEFAULT_MODEL_ID
    assert EngineConfig(model=kwargs["model"]).model is None


def test_bench_runs_the_default_model_for_its_name(tiny_default):
    from batchgen.bench.args import resolve_settings

    for name in NAMES:
        args = cli.build_parser().parse_args(["bench", "--model", name])
        resolve_settings(args)
        assert args.model == tiny_default


@pytest.mark.parametrize("name", NAMES)
def test_a_local_directory_of_that_name_wins(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).mkdir(parents=True)
    assert EngineConfig(model=name).model == name


@pytest.mark.parametrize(
    "name", ["batchgen/default-mixtral-v2", "batchgen/default-mixtral", "default-mixtral"]
)
def test_other_names_keep_their_error(name):
    assert EngineConfig(model=name).model == name
    with pytest.raises(ValueError, match="could not be resolved from the Hugging Face hub"):
        LLM(model=name)


def test_a_cluster_file_may_name_the_default_model(tiny_default, tmp_path):
    from batchgen.cluster_config import load_cluster_config
    from batchgen.entrypoints.config_check import report

    path = tmp_path / "cluster.yaml"
    path.write_text(f"batchgen_cluster:\n  model: '{DEFAULT_MODEL_ID}'\n  world_size: 2\n")
    cluster = load_cluster_config(path)
    assert cluster.engine.model is None
    lines = report(cluster)
    assert f"model: {DEFAULT_MODEL_ID} (the embedded default model)" in lines
    assert "experts per rank: all 4 (replicated)" in lines  # the tiny default's config.json


@pytest.mark.parametrize("name", NAMES)
def test_the_default_models_name_as_the_tokenizer(tmp_path, monkeypatch, name):
    """``--tokenizer`` takes the default model's names as ``--model`` does: with the default
    model it is the model's own (None), with another model it stands for the default model's
    tokenizer under its one name; a local directory of that name still wins."""
    assert EngineConfig(tokenizer=name).tokenizer is None
    assert EngineConfig(model=str(tmp_path), tokenizer=name).tokenizer == DEFAULT_MODEL_ID
    assert EngineConfig(model=DEFAULT_MODEL_ID, tokenizer=name).tokenizer is None
    args = cli.build_parser().parse_args(["run", "-i", "x", "-o", "y", "--tokenizer", name])
    assert EngineConfig(**cli.engine_kwargs(args)).tokenizer is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).mkdir(parents=True)
    assert EngineConfig(tokenizer=name).tokenizer == name


@pytest.mark.parametrize("name", NAMES)
def test_another_model_with_the_default_models_tokenizer(tiny_default, checkpoint_dir, name):
    """``LLM(model=other, tokenizer="batchgen/default-mixtral-v1")`` loads the default model's
    tokenizer (its folder, built on first use), not a hub id of that name (which failed)."""
    llama = str(checkpoint_dir("llama"))
    llm = LLM(model=llama, tokenizer=name)
    assert llm.llm_engine.model_name == llama.rsplit("/", 1)[-1]
    assert llm.llm_engine.config.model == llama
    assert llm.get_tokenizer().name_or_path == tiny_default
    assert len(_tokens(llm)) == 4
