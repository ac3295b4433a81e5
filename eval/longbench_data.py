"""LongBench rows from a folder of the official jsonl files or from a parquet copy on the Hub.

A row is the official record: ``input``, ``context``, ``answers`` (list of str), ``length``
(int: words, or characters for Chinese), ``all_classes`` (list of str or null), ``dataset``,
``language``, ``_id``. Files and Hub configs are named ``<dataset>`` (LongBench) or
``<dataset>_e`` (LongBench-E), as in the official ``data.zip`` and ``THUDM/LongBench``.

Hub source: the official dataset ``THUDM/LongBench`` cannot be loaded by current ``datasets``
(it is a loading script over ``data.zip``), so rows come from the Hub's own parquet export of
that same dataset, branch ``refs/convert/parquet``, files ``<config>/test/*.parquet``, read
with the ``parquet`` builder (all three are task keys: ``hub_dataset``, ``hub_revision``,
``hub_data_files``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse

from . import base
from .base import TaskConfigError, looked_for

REQUIRED_FIELDS = ("input", "context", "answers", "length", "all_classes")
"""Fields the prompt, the scorer and LongBench-E need in every row."""

HUB_UNREACHABLE = (
    "task.data_dir is not set and the Hugging Face Hub is unreachable: "
    "download LongBench data.zip and pass task.data_dir=/path/to/data"
)

_TRUE = {"1", "on", "yes", "true"}


def check_row(row: Any, where: str) -> None:
    """Check one row's required fields and their types.

    Raises:
        TaskConfigError: ``where`` (file and line, or Hub config and row) and what is wrong.
    """
    if not isinstance(row, dict):
        raise TaskConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in row]
    if missing:
        raise TaskConfigError(
            f"{where}: missing field {', '.join(repr(k) for k in missing)} (required: {', '.join(REQUIRED_FIELDS)})"
        )
    answers, classes = row["answers"], row["all_classes"]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise TaskConfigError(f"{where}: field 'answers' must be a list of strings")
    if classes is not None and (not isinstance(classes, list) or not all(isinstance(c, str) for c in classes)):
        raise TaskConfigError(f"{where}: field 'all_classes' must be null or a list of strings")
    if isinstance(row["length"], bool) or not isinstance(row["length"], int):
        raise TaskConfigError(f"{where}: field 'length' must be an integer")
    if not isinstance(row["input"], str) or not isinstance(row["context"], str):
        raise TaskConfigError(f"{where}: fields 'input' and 'context' must be strings")


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    """The first ``limit`` rows (all if None) of an official jsonl file, each checked by :func:`check_row`
    (:func:`eval.base.read_jsonl`; TaskConfigError names the file and the 1-based line)."""
    return base.read_jsonl(path, check_row, limit)


def check_data_dir(data_dir: str, configs: list[str]) -> list[Path]:
    """Paths of ``<config>.jsonl`` for each config in ``data_dir``.

    Raises:
        TaskConfigError: the folder is missing or empty, or a needed file is absent.
    """
    root = Path(os.path.expanduser(str(data_dir)))
    if not root.is_dir():
        raise TaskConfigError(
            f"task.data_dir={data_dir}: no such directory{looked_for(root)}; pass the folder of the official LongBench "
            "jsonl files (the data/ folder of data.zip)"
        )
    present = sorted(p.name for p in root.glob("*.jsonl"))
    if not present:
        raise TaskConfigError(
            f"task.data_dir={data_dir}: no .jsonl files; expected the official LongBench files "
            "(<dataset>.jsonl, <dataset>_e.jsonl), i.e. the data/ folder of data.zip"
        )
    paths = [root / f"{c}.jsonl" for c in configs]
    absent = [p.name for p in paths if not base.is_data_file(p)]
    if absent:
        shown = ", ".join(present[:8]) + (", ..." if len(present) > 8 else "")
        raise TaskConfigError(
            f"task.data_dir={data_dir}: missing {', '.join(absent)} (needed by task.datasets); found {shown}"
        )
    return paths


def hub_reachable(timeout_s: float = 5.0) -> bool:
    """False in offline mode (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``), else a quick TCP probe of
    the Hub endpoint (``HF_ENDPOINT``, default huggingface.co:443); True without probing when a proxy
    is configured (a direct connection proves nothing then)."""
    if any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return False
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def check_hub() -> None:
    """Raise TaskConfigError :data:`HUB_UNREACHABLE` unless :func:`hub_reachable`."""
    if not hub_reachable():
        raise TaskConfigError(HUB_UNREACHABLE)


def _is_network_error(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        mod = type(seen).__module__.split(".")[0]
        if isinstance(seen, (ConnectionError, TimeoutError, socket.gaierror)) or mod in ("httpx", "httpcore", "requests", "urllib3"):
            return True
        if type(seen).__name__ in ("OfflineModeIsEnabled", "LocalEntryNotFoundError"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def read_hub(repo: str, revision: str | None, data_files: str, config: str, limit: int | None = None) -> list[dict]:
    """The first ``limit`` rows of one config from the Hub parquet copy, checked.

    Raises:
        TaskConfigError: the Hub is unreachable (:data:`HUB_UNREACHABLE`), the files are not
            there, or a row lacks a required field.
    """
    check_hub()
    at = f"@{quote(revision, safe='')}" if revision else ""  # refs/convert/parquet: refs%2Fconvert%2Fparquet
    url = f"hf://datasets/{repo}{at}/{data_files.format(config=config)}"
    try:
        import datasets

        table = datasets.load_dataset("parquet", data_files={"test": url}, split="test")
    except Exception as e:  # noqa: BLE001 - turned into one line for the user
        if _is_network_error(e):
            raise TaskConfigError(HUB_UNREACHABLE) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TaskConfigError(
            f"task.hub_dataset={repo} (revision {revision}): cannot load {url}: {type(e).__name__}: {first}"
        ) from None
    n = len(table) if limit is None else min(limit, len(table))
    rows = [dict(table[i]) for i in range(n)]
    for i, row in enumerate(rows):
        check_row(row, f"{url} row {i}")
    return rows
