"""Checkpoint loading: sharded files, hub resolution, and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import LLM, SamplingParams
from batchgen.models.loader import WeightLoadError, resolve_model_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _copy(checkpoint_dir, tmp_path, name="mixtral"):
    dst = tmp_path / name
    shutil.copytree(checkpoint_dir(name), dst)
    return dst


def _rewrite(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_sharded_checkpoint_with_index_gives_same_tokens(checkpoint_dir, tmp_path):
    src = checkpoint_dir("mixtral")
    dst = _copy(checkpoint_dir, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, dst / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = LLM(str(src), device="cpu", kv_cache_memory_gb=0.01).generate(
        "hello", GREEDY, use_tqdm=False
    )
    b = LLM(str(dst), device="cpu", kv_cache_memory_gb=0.01).generate(
        "hello", GREEDY, use_tqdm=False
    )
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_transformers5_fused_expert_layout_loads(checkpoint_dir, tmp_path):
    """Checkpoints saved with fused `mlp.experts.gate_up_proj [E, 2I, H]` load identically."""
    src = checkpoint_dir("mixtral")
    dst = _copy(checkpoint_dir, tmp_path)

    def fuse(t):
        for layer in range(2):
            p = f"model.layers.{layer}.block_sparse_moe."
            w1 = [t.pop(f"{p}experts.{e}.w1.weight") for e in range(4)]
            w3 = [t.pop(f"{p}experts.{e}.w3.weight") for e in range(4)]
            w2 = [t.pop(f"{p}experts.{e}.w2.weight") for e in range(4)]
            q = f"model.layers.{layer}.mlp."
            t[q + "experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(w1, w3)])
            t[q + "experts.down_proj"] = torch.stack(w2)
            t[q + "gate.weight"] = t.pop(p + "gate.weight")

    _rewrite(dst, fuse)
    a = LLM(str(src), device="cpu", kv_cache_memory_gb=0.01).generate("hi", GREEDY, use_tqdm=False)
    b = LLM(str(dst), device="cpu", kv_cache_memory_gb=0.01).generate("hi", GREEDY, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_missing_tensor_is_named(checkpoint_dir, tmp_path):
    dst = _copy(checkpoint_dir, tmp_path)
    _rewrite(dst, lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight"))
    with pytest.raises(WeightLoadError, match=r"missing.*layers\.1\.mlp\.w13_weight"):
        LLM(str(dst), device="cpu", kv_cache_memory_gb=0.01)


def test_unexpected_tensor_is_named(checkpoint_dir, tmp_path):
    dst = _copy(checkpoint_dir, tmp_path)
    _rewrite(dst, lambda t: t.__setitem__("model.layers.0.extra_adapter.weight", torch.zeros(2)))
    with pytest.raises(WeightLoadError, match=r"unexpected.*model\.layers\.0\.extra_adapter"):
        LLM(str(dst), device="cpu", kv_cache_memory_gb=0.01)


def test_misshaped_tensor_is_named(checkpoint_dir, tmp_path):
    dst = _copy(checkpoint_dir, tmp_path)
    _rewrite(dst, lambda t: t.__setitem__("model.norm.weight", torch.ones(3)))
    with pytest.raises(WeightLoadError, match=r"model\.norm\.weight.*shape \(3,\)"):
        LLM(str(dst), device="cpu", kv_cache_memory_gb=0.01)


def test_slice_with_too_few_rows_is_named(checkpoint_dir, tmp_path):
    """A k_proj of 16 rows used to fill half of its 32 rows in qkv_proj without complaint."""
    dst = _copy(checkpoint_dir, tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(dst, lambda t: t.__setitem__(name, t[name][:16].clone()))
    with pytest.raises(WeightLoadError, match=r"k_proj\.weight.*shape \(16, 64\), expected \(32"):
        LLM(str(dst), device="cpu", kv_cache_memory_gb=0.01)


def test_unsupported_architecture_lists_supported(checkpoint_dir, tmp_path):
    dst = _copy(checkpoint_dir, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*MixtralForCausalLM"):
        LLM(str(dst), device="cpu")


def test_quantized_checkpoint_is_refused(checkpoint_dir, tmp_path):
    dst = _copy(checkpoint_dir, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method='fp8'"):
        LLM(str(dst), device="cpu")


def test_unresolvable_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"'no-such-org/no-such-model'.*HF_HUB_OFFLINE=1"):
        resolve_model_path("no-such-org/no-such-model")


def test_hub_id_resolves_from_local_cache(checkpoint_dir, monkeypatch, tmp_path):
    """An id already in the HF cache resolves offline, as `huggingface_hub` lays it out."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--acme--tiny-mixtral"
    commit = "0" * 40
    shutil.copytree(checkpoint_dir("mixtral"), repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    path = resolve_model_path("acme/tiny-mixtral")
    assert (path / "config.json").is_file()


def test_invalid_engine_settings_name_the_field(checkpoint_dir):
    path = str(checkpoint_dir("mixtral"))
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(path, dtype="int8")
    with pytest.raises(ValueError, match="device must be one of"):
        LLM(path, device="tpu")
    with pytest.raises(ValueError, match="max_model_len=99999 exceeds"):
        LLM(path, device="cpu", max_model_len=99999)
    with pytest.raises(ValueError, match="unknown LLM arguments.*'tensor_parallel'"):
        LLM(path, tensor_parallel=2)


def test_a_misspelt_llm_argument_gets_a_did_you_mean():
    """Before: the 43 allowed names and no hint (batch lines already had one)."""
    from batchgen.config import EngineConfig, ParallelConfig

    allowed = EngineConfig.field_names() + ParallelConfig.field_names()
    with pytest.raises(ValueError) as info:
        LLM(max_num_seq=3)  # fails before any model is built
    assert str(info.value) == (
        f"unknown LLM arguments ['max_num_seq'] (did you mean 'max_num_seqs'?); allowed: {allowed}"
    )
    with pytest.raises(ValueError) as info:
        LLM(dtyp="float32", max_num_seq=3, zzz=1)
    assert str(info.value).startswith(
        "unknown LLM arguments ['dtyp', 'max_num_seq', 'zzz'] (did you mean 'dtype' for 'dtyp', "
        "'max_num_seqs' for 'max_num_seq'?); allowed: ['model', "
    )
    with pytest.raises(ValueError) as info:
        LLM(zzz=1)
    assert str(info.value) == f"unknown LLM arguments ['zzz']; allowed: {allowed}"


def test_missing_local_directory_is_named_as_such():
    with pytest.raises(ValueError, match="model directory '/tmp/no/such/dir' does not exist"):
        resolve_model_path("/tmp/no/such/dir")
