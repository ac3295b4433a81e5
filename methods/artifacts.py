"""Offline artifacts of head- and layer-aware methods: locating and parsing them (plain JSON, never pickle).

The files, their formats, what writes and what reads them: ``methods/artifacts/README.md``. ``kvbench calibrate``
writes them under ``methods/artifacts/<model_name>/`` (:data:`FILE_NAMES`); a method config may name another path,
and the files the CompressKV authors published (:data:`PUBLISHED`) are found by :func:`artifact_path`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from .base import ConfigError, HeadLayout

ARTIFACTS_ROOT = Path(__file__).resolve().parent / "artifacts"

# artifact kind -> (file name under methods/artifacts/<model>/, calibrate sub-command that writes it)
FILE_NAMES: dict[str, tuple[str, str]] = {
    "retrieval_heads": ("retrieval_heads.json", "heads"),  # TRH / HeadKV "copy" scores
    "retrieval_reasoning_heads": ("retrieval_reasoning_heads.json", "heads"),  # HeadKV-R2 scores
    "semantic_retrieval_heads": ("semantic_retrieval_heads.json", "heads"),  # SRH raw scores (Eq. 1)
    "srh_head_idx": ("srh_head_idx.json", "heads"),  # {layer: ranked ids} by SRH score
    "trh_head_idx": ("trh_head_idx.json", "heads"),  # {layer: ranked ids} by TRH score
    "layer_score": ("layer_score.jsonl", "layers"),  # error-aware layer scores (Eq. 2-4)
}


# model name -> published CompressKV file prefix; and which kinds those files provide
PUBLISHED: dict[str, str] = {"llama31": "Llama-3.1-8B-Instruct", "mistral": "Mistral-7B-Instruct-v0.3"}
_PUBLISHED_FILES = {
    "srh_head_idx": "{}_head_idx.json",
    "layer_score": "{}_layer_score.jsonl",
    "trh_head_idx": "{}.json",  # raw TRH scores, ranked on load
    "retrieval_heads": "{}.json",  # the same raw TRH scores, HeadKV format
}


def published_dirs() -> list[Path]:
    """Folders searched for published artifacts (``$KVBENCH_ARTIFACTS_DIR``, then the shared data)."""
    root = Path(__file__).resolve().parents[1]
    data = Path(os.environ.get("KVBENCH_SHARED_DATA") or root / ".." / "shared" / "data")
    dirs = [Path(os.environ["KVBENCH_ARTIFACTS_DIR"])] if os.environ.get("KVBENCH_ARTIFACTS_DIR") else []
    return dirs + [data / "head_scores" / "compresskv"]


def artifact_path(kind: str, model_name: str, explicit: str | None, key: str) -> Path:
    """The existing file an artifact of ``kind`` (a key of :data:`FILE_NAMES`) is read from.

    Order: ``explicit`` (relative to the working directory); else
    ``methods/artifacts/<model_name>/<file>``; else, for a model in :data:`PUBLISHED`, the
    published file in :func:`published_dirs`. ConfigError: ``<key>=<path>: file not found; make it with ...``."""
    file_name, command = FILE_NAMES[kind]
    if not explicit and not model_name:
        raise ConfigError(f"{key}=null: no path given and the model has no name to find methods/artifacts/<model>/{file_name}")
    path = Path(explicit).expanduser() if explicit else ARTIFACTS_ROOT / model_name / file_name
    published = not explicit and model_name in PUBLISHED and kind in _PUBLISHED_FILES
    name = _PUBLISHED_FILES[kind].format(PUBLISHED[model_name]) if published else ""
    found = [path] if path.is_file() else [d / name for d in published_dirs() if published and (d / name).is_file()]
    if not found:
        hint = f", or set KVBENCH_SHARED_DATA to the folder holding head_scores/compresskv/{PUBLISHED.get(model_name)}*"
        raise ConfigError(f"{key}={str(path)!r}: file not found; make it with `kvbench calibrate {command} "
                          f"--name {model_name or '<name>'}` or give an existing path{hint if published else ''}")
    return found[0]


@contextlib.contextmanager
def keyed_errors(key: str, path: Path) -> Iterator[None]:
    """Re-raise a loader's ``ConfigError`` about ``path`` (``<path>: line 1 is not valid JSON``)
    as ``<key>='<path>': ...``, so the one-line error names the config key to change."""
    try:
        yield
    except ConfigError as e:
        if not str(e).startswith(f"{path}: "):
            raise
        raise ConfigError(f"{key}={str(path)!r}: {str(e)[len(str(path)) + 2:]}") from None


#: files read by the loaders since the last :func:`reset_files_read`: name -> SHA-256 of the bytes
_FILES_READ: dict[str, str] = {}


def _read_text(path: Path) -> str:
    """The file's text; its SHA-256 is recorded for :func:`files_read` (a job's provenance)."""
    data = Path(path).read_bytes()
    _FILES_READ[artifact_name(path)] = hashlib.sha256(data).hexdigest()
    return data.decode("utf-8")


def artifact_name(path: str | Path) -> str:
    """How a job records an artifact file: relative to ``methods/artifacts/`` when inside it (so a
    moved checkout reads the same), else the absolute path."""
    resolved = Path(path).resolve()
    return (resolved.relative_to(ARTIFACTS_ROOT).as_posix() if resolved.is_relative_to(ARTIFACTS_ROOT)
            else str(resolved))


def reset_files_read() -> None:
    """Forget the files recorded so far (a job calls it before its method loads its artifacts)."""
    _FILES_READ.clear()


def files_read() -> dict[str, str]:
    """``{file: sha256}`` of every artifact file the loaders read since :func:`reset_files_read`."""
    return dict(sorted(_FILES_READ.items()))


def _read_json(path: Path) -> object:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _format_error(path: Path, expected: str, why: object) -> ConfigError:
    return ConfigError(f"{path}: expected {expected} ({why})")


def load_head_scores(path: str | Path, layout: HeadLayout | None = None) -> torch.Tensor:
    """``(L, H_q)`` float64 per-head mean scores (HeadKV's ``np.mean``) from a file ``{"<layer>-<head>": [scores...]}``.
    ConfigError: malformed keys or lists, missing heads, a grid other than ``layout``'s."""
    path, expected = Path(path), "{'<layer>-<head>': [scores]}"
    data = _read_json(path)
    try:
        means = {tuple(int(x) for x in k.split("-", 1)): math.fsum(v) / len(v) for k, v in data.items()}
        out = torch.zeros(1 + max(l for l, _ in means), 1 + max(h for _, h in means), dtype=torch.float64)
        out[tuple(torch.tensor(list(means)).T)] = torch.tensor(list(means.values()), dtype=torch.float64)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError) as e:
        raise _format_error(path, expected, f"a key that is not '<layer>-<head>' or a value not a non-empty list "
                                            f"of numbers: {type(e).__name__}") from None
    if len(means) != out.numel():
        raise _format_error(path, expected, f"{len(means)} heads do not fill a {out.shape[0]}x{out.shape[1]} grid")
    if layout is not None and tuple(out.shape) != (layout.num_layers, layout.num_q_heads):
        raise ConfigError(f"{path}: scores for {out.shape[0]} layers x {out.shape[1]} query heads, but model "
                          f"{layout.model_name or '?'} has {layout.num_layers} x {layout.num_q_heads}")
    return out


def load_head_ranking(path: str | Path, layout: HeadLayout | None = None) -> list[list[int]]:
    """L lists of query-head ids, best first, from a CompressKV ``*_head_idx.json`` file
    ``{"<layer>": [ids]}``, or from a head-score file (ranked by :func:`ranking_from_scores`). ConfigError:
    layers not 0..L-1, ids repeated, negative or out of ``layout``'s range."""
    path = Path(path)
    data = _read_json(path)
    if isinstance(data, dict) and data and all("-" in str(k) for k in data):
        return ranking_from_scores(load_head_scores(path, layout))
    try:
        ranking = [[int(h) for h in data[str(i)]] for i in range(len(data))]
    except (KeyError, TypeError, ValueError) as e:
        raise _format_error(path, "{'0': [head ids], ..., 'L-1': [...]} (layer keys)", type(e).__name__) from None
    n_heads = layout.num_q_heads if layout is not None else None
    for i, ids in enumerate(ranking):
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or (n_heads and max(ids) >= n_heads):
            raise ConfigError(f"{path}: layer {i} repeats a head id or names head {max(ids or [-1])} of "
                              f"{n_heads or '?'} query heads; each layer needs distinct ids in range")
    if layout is not None and len(ranking) != layout.num_layers:
        raise ConfigError(f"{path}: {len(ranking)} layers, but model {layout.model_name or '?'} has {layout.num_layers}")
    return ranking


def load_layer_scores(path: str | Path, layout: HeadLayout | None = None, key: str = "avg_score") -> torch.Tensor:
    """``(L,)`` float64 per-layer error scores (CompressKV Eq. 4) from a ``*_layer_score.jsonl``
    file (one JSON object, or one ``{dataset: [L scores]}`` per line); ``key`` picks the list,
    ``avg_score`` computed when absent (mean over datasets, L1-normalised, as ``get_avg.py``). ConfigError:
    unreadable file, unknown key, lists of different lengths, negative values."""
    path = Path(path)
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = {}
        for n, line in enumerate(text.splitlines(), 1):
            try:
                data.update(json.loads(line) if line.strip() else {})
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: line {n} is not valid JSON ({e})") from None
    if key not in data and (key != "avg_score" or not data):
        raise ConfigError(f"method.layer_score_key={key!r}: not in {path}; accepted values are {', '.join(data)}")
    try:
        per_dataset = torch.tensor(list(data.values()) if key not in data else data[key], dtype=torch.float64)
    except (TypeError, ValueError) as e:
        raise _format_error(path, "{'<dataset>': [per-layer scores], 'avg_score': [...]}", e) from None
    scores = per_dataset if key in data else per_dataset.mean(dim=0) / (per_dataset.mean(dim=0).sum() + 1e-12)
    if (scores < 0).any() or not torch.isfinite(scores).all():
        raise ConfigError(f"{path}: {key} has negative or non-finite values")
    if layout is not None and scores.numel() != layout.num_layers:
        raise ConfigError(f"{path}: {scores.numel()} layers, but model {layout.model_name or '?'} has {layout.num_layers}")
    return scores


def ranking_from_scores(scores: torch.Tensor) -> list[list[int]]:
    """L lists of H head ids, each layer's heads by ``(L, H)`` score, best first, ties to the lower
    id (CompressKV ``get_retrieval_head_idx_per_layer.py``'s stable descending sort)."""
    return torch.sort(scores.double(), dim=-1, descending=True, stable=True).indices.tolist()


def top_heads(scores: torch.Tensor, k: int, key: str = "k", lowest: int = 0) -> list[tuple[int, int]]:
    """The k ``(layer, query-head id)`` pairs with the highest of the ``(L, H_q)`` scores across all layers, best
    first: the head set of Wu et al. (2025)'s masking test, CompressKV Sec. 4.3 / Table 2a (docs/COMPRESSKV.md).
    Ties keep the layer-major order of the score files, as the reference's stable sort of the file's items does.
    ConfigError: ``<key>=<k>`` below ``lowest`` or above L·H_q."""
    n_layers, n_heads = scores.shape
    if not lowest <= k <= n_layers * n_heads:
        raise ConfigError(f"{key}={k}: must be between {lowest} and the {n_layers}x{n_heads} = {n_layers * n_heads} "
                          "heads of the score file")
    order = torch.sort(scores.double().flatten(), descending=True, stable=True).indices[:k]
    return [(int(i) // n_heads, int(i) % n_heads) for i in order]
