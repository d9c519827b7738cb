"""``batchgen make-model`` in process: it never replaces a checkpoint's files unless told to
(before, a mistyped ``--out`` silently overwrote config.json and the tokenizer of a real
checkpoint), and its ``--arch`` help and errors list the architectures."""

from __future__ import annotations

import json
import os

import pytest

from batchgen.entrypoints import cli
from batchgen.models import make_model as make_model_module
from batchgen.models.make_model import CHECKPOINT_FILES, MADE_BY_FILE
from batchgen.models.model_config import SUPPORTED_MAKE_ARCHS


@pytest.fixture
def made(monkeypatch):
    """The directories `make_model` is called for (nothing is written)."""
    calls: list[str] = []
    monkeypatch.setattr(
        make_model_module, "make_model", lambda arch, out, seed: calls.append(str(out)) or out
    )
    return calls


def test_a_directory_holding_checkpoint_files_is_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "ckpt"
    argv = ["make-model", "--arch", "llama", "--out", str(out)]
    out.mkdir()  # an existing empty directory is fine
    assert cli.main(argv) == 0
    # the list is what it writes, and the note that make-model made it
    assert sorted(os.listdir(out)) == sorted([*CHECKPOINT_FILES, MADE_BY_FILE])
    assert json.loads((out / MADE_BY_FILE).read_text()) == {
        "arch": "llama", "seed": 0, "overrides": {}
    }
    assert capsys.readouterr().out == f"{out}\n"
    assert cli.main(argv) == 0  # its own output is replaced: the README's commands run twice
    assert capsys.readouterr().out == f"{out}\n"

    # A real checkpoint's files (here: another architecture's) are left as they are.
    (out / MADE_BY_FILE).unlink()
    (out / "config.json").write_text('{"model_type": "mixtral"}')
    (out / "README.md").write_text("my model")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"batchgen make-model: error: --out {str(out)!r} already holds config.json, "
        "generation_config.json, model.safetensors, special_tokens_map.json, tokenizer.json, "
        "tokenizer_config.json (a checkpoint?), which make-model would replace: name another "
        "directory, or pass --overwrite\n"
    )
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before

    assert cli.main([*argv, "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert (out / "README.md").read_text() == "my model"  # not a file make-model writes


def test_one_checkpoint_file_is_enough_to_refuse(tmp_path, made, capsys):
    out = tmp_path / "d"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    assert cli.main(["make-model", "--arch", "mixtral", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"batchgen make-model: error: --out {str(out)!r} already holds tokenizer.json (a "
        "checkpoint?), which make-model would replace: name another directory, or pass "
        "--overwrite\n"
    )
    assert made == []


def test_other_files_a_missing_directory_and_a_file_as_out(tmp_path, made, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("x")
    new = tmp_path / "new" / "ckpt"
    for out in (notes, new):
        assert cli.main(["make-model", "--arch", "qwen2", "--out", str(out)]) == 0
    assert made == [str(notes), str(new)]
    a_file = tmp_path / "model.safetensors"
    a_file.write_bytes(b"weights")
    assert cli.main(["make-model", "--arch", "qwen2", "--out", str(a_file)]) == 2
    assert capsys.readouterr().err.endswith(
        f"batchgen make-model: error: --out {str(a_file)!r} is a file; name a directory for "
        "the checkpoint\n"
    )
    assert a_file.read_bytes() == b"weights" and len(made) == 2


def test_arch_help_and_errors_list_the_architectures(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["make-model", "--help"])
    assert info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"--arch ARCH architecture, one of: {', '.join(SUPPORTED_MAKE_ARCHS)}" in help_text
    assert "mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3, llama" in help_text
    assert "--overwrite replace the checkpoint files already in --out" in help_text

    with pytest.raises(SystemExit) as info:
        cli.main(["make-model", "--arch", "gpt2", "--out", "x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: batchgen make-model ")
    last = err.splitlines()[-1].replace("'", "")  # quoting differs between Python versions
    assert last == (
        "batchgen make-model: error: argument --arch: invalid choice: gpt2 (choose from "
        f"{', '.join(SUPPORTED_MAKE_ARCHS)})"
    )
