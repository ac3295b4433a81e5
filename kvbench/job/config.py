"""Job configuration: Hydra composes ``conf/`` once; :func:`check` validates it once and names the job.

The schemas (:func:`register`) and the checks: docs/ARCHITECTURE.md, step 2. Every problem is a
:class:`~methods.base.ConfigError` (or ``TaskConfigError``), one line naming the key and the accepted values.
The job folder and what its hash covers (:func:`identity`, :func:`job_relpath`): docs/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import eval as tasks
import methods
from eval.base import TaskConfigError
from methods.base import ConfigError, check_budget, structured

from kvbench.engine.models import CHAT_FORMATS

CONF = Path(__file__).resolve().parents[2] / "conf"
CONF_MODEL_DIR = CONF / "model"
#: keys that choose which samples run (the sample ids encode them), not how one is computed
SELECTION_KEYS = ("context_lengths", "depth_percents", "datasets", "n_samples", "subtasks")
#: settings added after results were stored with them unset: at this value they stay out of the identity (the folders resume)
FORMER = {("model", "compress_sliding_layers"): False, ("method", "score_dtype"): "float32", ("task", "compress"): "prompt"}
DTYPES = ("float32", "bfloat16", "float16")
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass
class Shard:
    index: int = 0
    count: int = 1


@dataclass
class Sweep:
    share_prefill: bool = False  # docs/SWEEPS.md: a local sweep's jobs that differ in method and budget share prefills


@dataclass
class Decode:
    """Compression while decoding (docs/DECODING.md)."""

    interval: int = 0  # compress every `interval` decode steps to `budget` tokens (an integer); 0: at the end of prefill only
    prefill: bool = True  # with interval > 0: compress the prompt at the end of prefill too (false: decode-only)
    schedule: str = "steps"  # steps (kvpress DecodingPress) | length (R-KV: when the tokens fed are a multiple of interval)


@dataclass
class Sampling:
    """Sampled candidates (docs/DECODING.md); temperature 0 is greedy decoding."""

    n: int = 1  # candidates per sample (temperature > 0), each its own record <id>#<k>
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off


@dataclass
class Cache:
    """``cache.*``: how the kept tokens are stored (kvbench/engine/quantcache.py, docs/QUANTIZATION.md)."""

    bits: Optional[int] = None  # null: the model dtype; 2, 4, 8: KIVI-quantized (keys per channel, values per token)
    group_size: int = 32  # entries per scale and minimum: tokens of a key channel, channels of a value token
    residual: int = 128  # tokens per quantized block: the last (T mod residual) stay in full precision; 0: group_size

    def __post_init__(self):
        if self.bits not in (None, 2, 4, 8):
            raise ConfigError(f"cache.bits={self.bits}: accepted values are null (the model dtype), 2, 4, 8")
        if self.group_size < 1:
            raise ConfigError(f"cache.group_size={self.group_size}: must be an integer >= 1 (it divides the head dim)")
        if self.residual < 0 or self.residual % self.group_size:
            raise ConfigError(f"cache.residual={self.residual}: must be 0 or a multiple of cache.group_size="
                              f"{self.group_size} (keys are quantized in whole groups of tokens)")


@dataclass
class TopConfig:
    """conf/config.yaml's keys (``model``, ``method`` and ``task`` are checked by their own schemas)."""

    model: Any = None
    method: Any = None
    task: Any = None
    budget: Any = 0.25
    seed: int = 42
    device: str = "auto"
    output_root: str = "results"
    run_tag: Optional[str] = None
    run_name: Optional[str] = None
    max_samples: Optional[int] = None
    shard: Shard = field(default_factory=Shard)
    sweep: Sweep = field(default_factory=Sweep)
    decode: Decode = field(default_factory=Decode)
    sampling: Sampling = field(default_factory=Sampling)
    cache: Cache = field(default_factory=Cache)
    lock_wait_s: float = 0.0
    quiet: bool = False
    threads: Any = "auto"
    compile: Any = False  # torch.compile the decode step: false, true, auto (CUDA, one device)
    per_model: Any = None  # experiment presets: per-model helper tables for interpolations
    latency: Any = None  # the latency benchmark's node (conf/experiment/selkv_fig3*.yaml)

    def __post_init__(self):
        self.budget = check_budget(self.budget)
        if not -2**63 <= self.seed < 2**64:
            raise ConfigError(f"seed={self.seed}: must be an integer from -2**63 to 2**64 - 1 (torch.manual_seed's range)")
        if self.device not in ("auto", "cpu", "cuda", "mps") and not (self.device.startswith("cuda:")
                                                                      and self.device[5:].isdigit()):
            raise ConfigError(f"device={self.device}: accepted values are auto, cpu, cuda, cuda:<index>, mps")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"max_samples={self.max_samples}: must be an integer >= 1 or null")
        if self.shard.count < 1 or not 0 <= self.shard.index < self.shard.count:
            raise ConfigError(f"shard.index={self.shard.index}, shard.count={self.shard.count}: accepted values are "
                              "count >= 1 and 0 <= index < count")
        if self.lock_wait_s < 0:
            raise ConfigError(f"lock_wait_s={self.lock_wait_s}: must be a number of seconds >= 0")
        if self.threads != "auto" and self.threads is not None and (not isinstance(self.threads, int)
                                                                    or not 1 <= self.threads <= 4 * (os.cpu_count() or 1)):
            raise ConfigError(f"threads={self.threads}: accepted values are auto, null or an integer from 1 to "
                              f"{4 * (os.cpu_count() or 1)} (4 x this machine's cores)")
        if self.compile not in ("auto", True, False):
            raise ConfigError(f"compile={self.compile}: accepted values are auto, true, false")
        d, s = self.decode, self.sampling
        if d.interval < 0 or d.schedule not in ("steps", "length"):
            raise ConfigError(f"decode.interval={d.interval}, decode.schedule={d.schedule}: accepted values are an "
                              "integer >= 0 (0: off) and steps, length")
        if d.interval and self.compile is True:
            raise ConfigError(f"decode.interval={d.interval}: needs eager decoding (compile=false or auto)")
        if not d.prefill and not d.interval:
            raise ConfigError("decode.prefill=false: decode-only compression needs decode.interval > 0 (0: at the end "
                              "of prefill only)")
        if s.n < 1 or s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < 0 or (s.n > 1 and not s.temperature):
            raise ConfigError(f"sampling.n={s.n}, temperature={s.temperature}, top_p={s.top_p}, top_k={s.top_k}: "
                              "accepted values are n >= 1 (> 1 only with temperature > 0), temperature >= 0 (0: greedy), "
                              "0 < top_p <= 1, top_k >= 0 (0: off)")
        if not str(self.output_root).strip():
            raise ConfigError("output_root='': must name a folder for the results (default: results)")
        if self.run_tag is not None and ("/" in str(self.run_tag) or not str(self.run_tag).strip()):
            raise ConfigError(f"run_tag={self.run_tag}: must be a non-empty name without '/' (a suffix of the job folder)")
        if self.run_name is not None and (Path(self.run_name).is_absolute() or ".." in Path(self.run_name).parts
                                          or not self.run_name.strip()):
            raise ConfigError(f"run_name={self.run_name}: must be a relative folder path inside output_root (no '..')")


@dataclass
class ModelConfig:
    """conf/model/*.yaml: source and the protocol facts of one model."""

    name: str
    source: str
    gguf_file: Optional[str] = None
    gguf_cache: Any = "auto"  # auto | true | false: convert a GGUF once to safetensors (kvbench.engine.models)
    max_input_length: int = 3500
    dtype: dict = field(default_factory=lambda: {"cuda": "bfloat16", "cpu": "float32"})
    chat_template: Any = True  # true (the tokenizer's), vicuna (FastChat's, LongBench pred.py), none/false (raw prompt)
    tokenizer: str = "fast"  # fast | slow (LongBench's pred.py loads LongChat's slow tokenizer)
    stop_tokens: list = field(default_factory=list)
    stop_ids: list = field(default_factory=list)
    device_map: Any = None
    trust_remote_code: bool = False
    generation_config: bool = True  # apply the model's generation_config logits processors (greedy), as model.generate
    compress_sliding_layers: bool = False  # Gemma 2/3: also compress sliding-window layers when a prompt fits their window

    def __post_init__(self):
        if self.chat_template not in (True, False, "none", *CHAT_FORMATS):
            raise ConfigError(f"model.chat_template={self.chat_template}: accepted values are true (the tokenizer's "
                              f"template), {', '.join(CHAT_FORMATS)}, none")
        if self.tokenizer not in ("fast", "slow"):
            raise ConfigError(f"model.tokenizer={self.tokenizer}: accepted values are fast, slow")
        if self.gguf_cache not in ("auto", True, False):
            raise ConfigError(f"model.gguf_cache={self.gguf_cache}: accepted values are auto, true, false")
        for dev, name in self.dtype.items():
            if name not in DTYPES:
                raise ConfigError(f"model.dtype.{dev}={name}: accepted values are {', '.join(DTYPES)}")
        if self.max_input_length < 2:
            raise ConfigError(f"model.max_input_length={self.max_input_length}: must be an integer >= 2 (tokens)")
        if not all(isinstance(t, str) for t in self.stop_tokens):
            raise ConfigError(f"model.stop_tokens={self.stop_tokens}: must be a list of token strings, e.g. ['<|im_end|>']")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_ids):
            raise ConfigError(f"model.stop_ids={self.stop_ids}: must be a list of token ids (integers >= 0)")
        dm = self.device_map
        if not (dm is None or isinstance(dm, dict) or dm in DEVICE_MAPS or dm == "cpu"
                or (isinstance(dm, int) and dm >= 0) or (isinstance(dm, str) and dm.startswith("cuda"))):
            raise ConfigError(f"model.device_map={dm}: accepted values are null, {', '.join(DEVICE_MAPS)}, a device "
                              "(cpu, cuda, cuda:1, a GPU index) or a mapping of module names to devices")


def conf_model(name: str, key: str = "--model") -> dict:
    """``conf/model/<name>.yaml`` (or a YAML file path) as a dict, the schema's defaults filled in
    (:class:`ModelConfig`), for the command-line tools that take ``--model``. ConfigError naming ``key`` and the
    accepted names when there is no such file, or naming the model key that is wrong."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else CONF_MODEL_DIR / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in CONF_MODEL_DIR.glob("*.yaml")))
        raise ConfigError(f"{key}={name!r}: no such model config; accepted values are {names}")
    node = {k: v for k, v in yaml.safe_load(path.read_text(encoding="utf-8")).items() if k != "defaults"}
    return dataclasses.asdict(structured(ModelConfig, node, "model."))


def register() -> None:
    """Store the schemas in Hydra's ConfigStore before any composition (``hydra_plugins/kvbench_launcher``): ``kvbench``
    (the top level), ``schema/model``, ``schema/method/<name>`` and ``schema/task/<name>``, which ``conf/`` extends."""
    store = ConfigStore.instance()
    store.store(name="kvbench", node=TopConfig)
    store.store(group="schema", name="model", node=ModelConfig)
    for name in methods.available():
        store.store(group="schema/method", name=name, node=methods.schema(name))
    plugin = OmegaConf.create({"name": methods.PLUGIN, "label": None, "target": "???"})
    OmegaConf.set_struct(plugin, False)  # method.<field>= of the class's Config: checked by methods.build_method
    store.store(group="schema/method", name=methods.PLUGIN, node=plugin)
    for name in tasks.available():
        store.store(group="schema/task", name=name, node=tasks.get_task_class(name).Config)


def compose(overrides: list[str], **kw: Any) -> Any:
    """``conf/config.yaml`` composed by Hydra with ``overrides`` (``kw``: of ``hydra.compose``)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hydra_compose("config", overrides, **kw)


def preset(group: str, name: str) -> dict:
    """``conf/<group>/<name>.yaml`` as Hydra composes it, its schema's defaults filled in (a plain dict)."""
    return OmegaConf.to_container(compose([f"{group}={name}"])[group], resolve=True, enum_to_str=True)


def resolved_inputs(task: dict, tokenizer: Any = None) -> tuple[dict, dict]:
    """What the task will read, resolved once: ``(inputs, resolved)``. ``inputs`` is part of the job's
    identity: the NIAH haystack actually used (its source after ``auto`` and the SHA-256 of its text),
    RULER's generated files and their SHA-256 (``task.generate``; ``tokenizer()``: the model's tokenizer), or
    the data files and their SHA-256 (``task.data_dir``; the Hub dataset and revision otherwise).
    ``resolved`` is what the task is built with (``{"haystack": (text, source)}`` for NIAH, ``{"files":
    {relative path: text}}`` generated, which the job writes into its folder).

    Raises:
        TaskConfigError: a haystack folder or data folder that does not exist or is empty.
    """
    if task["name"] == "niah":
        from eval.niah import load_haystack

        text, source = load_haystack(task)
        kind = "dir" if source.startswith("dir:") else source  # the essays' text counts, not their folder
        return {"haystack": kind, "haystack_sha256": hashlib.sha256(text.encode()).hexdigest()}, {"haystack": (text, source)}
    if task.get("generate"):
        from eval.ruler import generated

        files = generated(task, tokenizer())
        return {"generated": {k: hashlib.sha256(v.encode()).hexdigest() for k, v in files.items()}}, {"files": files}
    if task.get("data_dir"):
        files = tasks.get_task_class(task["name"]).data_files(task)
        if not files:
            raise TaskConfigError(f"task.data_dir={task['data_dir']}: no such folder, or no .jsonl/.json files in it")
        root = Path(task["data_dir"]).expanduser()
        return {"data_files": {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}}, {}
    return {"hub": [task.get("hub_dataset"), task.get("hub_revision")]}, {}


@dataclass
class JobSpec:
    """A checked job, built once by :func:`check` from the composed config; everything downstream takes
    it and nothing re-checks it.

    Attributes:
        cfg: the plain config (``config.yaml``); ``top``: its typed top level (``top.budget``: the checked budget).
        method: the built method (its layout set, artifacts read).
        source: the resolved model source ``(path, gguf_file)``; ``layout``: the model's head layout.
        inputs: the resolved inputs in the identity (hashes); ``resolved``: what the task reads, read once.
        artifacts: the artifact files the method read. ``identity``/``relpath``: the job folder's name.
    """

    cfg: dict
    top: TopConfig
    method: Any
    source: tuple[str, str | None]
    layout: Any
    inputs: dict
    resolved: dict
    artifacts: dict
    identity: dict
    relpath: str


def _package(source: str) -> str:
    """``pypi:<module>`` with the installed distribution's version (not its path: any venv is the same model)."""
    from importlib.metadata import PackageNotFoundError, version

    module = source.split(":", 1)[1]
    try:
        return f"{source}=={version(module.replace('_', '-'))}"
    except PackageNotFoundError:
        return source


def identity(cfg: dict, source: tuple[str, str | None], inputs: dict, device: str) -> dict:
    """Every resolved setting that can change a result: model (resolved source, dtype on this
    device), method (its label excepted), task (the sample selection excepted) and its resolved
    inputs, budget (not for the full cache, which keeps every token), seed; decode-time compression and sampling
    settings when on."""
    model = {k: v for k, v in cfg["model"].items()
             if k not in ("name", "gguf_cache", "device_map") and FORMER.get(("model", k), ...) != v}
    model.update(dtype=cfg["model"]["dtype"].get(device, "float32"),
                 source=_package(cfg["model"]["source"]) if cfg["model"]["source"].startswith("pypi") else list(source))
    return {
        "model": model,
        "method": {k: v for k, v in cfg["method"].items() if k != "label" and FORMER.get(("method", k), ...) != v},
        "task": {k: v for k, v in cfg["task"].items() if k not in (*SELECTION_KEYS, "data_dir", "haystack_dir", "qa_files", "cwe_words")
                 and FORMER.get(("task", k), ...) != v},
        "inputs": inputs,
        "budget": None if cfg["method"]["name"] == "full" else cfg["budget"],
        "seed": cfg["seed"],
        "device": device,
        # only when on (earlier folders resume); sampling.n chooses records, as max_samples does
        **({"decode": cfg["decode"]} if (cfg.get("decode") or {}).get("interval") and cfg["method"]["name"] != "full" else {}),
        **({"sampling": {k: v for k, v in cfg["sampling"].items() if k != "n"}}
           if (cfg.get("sampling") or {}).get("temperature") else {}),
        **({"cache": cfg["cache"]} if (cfg.get("cache") or {}).get("bits") else {}),  # a quantized cache only
    }


def job_relpath(cfg: dict, preset: str | None, ident: dict) -> str:
    """``<task>/<model>/<preset>/b<budget>[-q<bits>][-<run_tag>]-<hash>`` (or ``<run_name>-<hash>``)."""
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:8]
    if cfg.get("run_name"):
        return f"{cfg['run_name']}-{digest}"
    parts = [] if cfg["method"]["name"] == "full" else [f"b{cfg['budget']}"]
    parts += [f"q{ident['cache']['bits']}"] if "cache" in ident else []
    parts += [str(cfg["run_tag"])] if cfg.get("run_tag") else []
    return f"{cfg['task']['name']}/{cfg['model']['name']}/{preset or cfg['method']['name']}/{'-'.join(parts + [digest])}"


def device_type(device: str) -> str:
    """``cuda`` or ``cpu`` (``auto``: CUDA when present). ConfigError: CUDA asked for on a machine without it."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = device.split(":")[0]
    if kind == "cuda" and (not torch.cuda.is_available() or int(device[5:] or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"device={device}: this machine has {torch.cuda.device_count()} CUDA device(s); use device=auto or cpu")
    return kind


def check(cfg: Any, preset: str | None = None) -> JobSpec:
    """Validate a composed job config once and resolve its inputs; return the :class:`JobSpec`.

    Raises:
        ConfigError / TaskConfigError: the first problem found, as one line naming the key.
    """
    from methods import artifacts
    from kvbench.engine.models import head_layout, load_tokenizer, read_config, resolve_source

    try:  # Hydra checked keys, types and choices against the schemas (register); their __post_init__ check ranges
        plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        for group in ("model", "method", "task"):
            if not isinstance(plain.get(group), dict):
                raise ConfigError(f"{group}: missing; it is required (see conf/config.yaml)")
        top = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # a missing value, also behind an interpolation (label: ${.press})
        missing = re.search(r"Missing mandatory value: ([\w.]+)", str(e.msg))
        key = missing and (missing[1] if "." in missing[1] else e.full_key)
        raise ConfigError(f"{key}: missing; it is required (docs/METHODS.md)" if missing
                          else f"{e.full_key}: {str(e.msg).splitlines()[0]}") from None
    for prefix, node, given in (("", top, plain), ("model.", top.model, plain["model"]), ("task.", top.task, plain["task"])):
        keys = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []  # + passes Hydra
        if keys and set(given) - set(keys):  # (the method's keys: build_method)
            raise ConfigError(f"{prefix}{min(set(given) - set(keys))}: unknown key; accepted keys are {', '.join(keys)}")
    plain["budget"], model = top.budget.value, top.model  # 64.0 is the token budget 64, 0.30000000000000004 the ratio 0.3
    method = methods.build_method(plain["method"])
    task, name = plain["task"], str(plain["task"].get("name"))
    tasks.get_task_class(name).validate(task)
    methods.check_min_budget(method, top.budget)
    if method.reads and top.compile is True:
        raise ConfigError(f"compile=true: method {method.name} decodes eager; use compile=false or auto")
    if top.decode.interval and method.name != "full":  # the full cache: nothing to cut
        if not method.decodes:
            raise ConfigError(f"decode.interval={top.decode.interval}: method {plain['method'].get('label')} does not compress while "
                              "decoding; accepted methods are the scoring ones (docs/DECODING.md)")
        if top.budget.tokens is None:
            raise ConfigError(f"decode.interval={top.decode.interval}: needs an integer token budget (budget={top.budget})")
    limit = int(task.get("max_length") or model.max_input_length)
    if task.get("max_new_tokens") and name == "niah" and min(task["context_lengths"]) > limit:
        raise TaskConfigError(f"task.context_lengths={task['context_lengths']}: every length exceeds the prompt budget "
                              f"of {limit} tokens (model.max_input_length / task.max_length)")
    source = resolve_source(plain["model"])
    hf_config = read_config(plain["model"], source)  # the layout and context window, without the weights
    method.layout = layout = head_layout(hf_config, model.name, model.compress_sliding_layers)
    if (bits := top.cache.bits) and (layout.head_dim % top.cache.group_size or layout.head_dim % (8 // bits)):
        raise ConfigError(f"cache.group_size={top.cache.group_size}: must divide the model's head dim "
                          f"({layout.head_dim}, which {8 // bits} {bits}-bit codes per byte must divide too)")
    if bits and method.per_head_lengths:
        raise ConfigError(f"cache.bits={bits}: method {method.name} keeps per-head lengths, which the quantized cache "
                          "does not store; use a method with one length per layer, or cache.bits=null")
    artifacts.reset_files_read()
    method.check_layout(layout)  # reads the method's artifact files (head / layer scores)
    window = getattr(hf_config.get_text_config(), "max_position_embeddings", None)
    if name == "niah" and window and min(max(task["context_lengths"]), limit) + task["max_new_tokens"] > window:
        raise ConfigError(f"task.max_new_tokens={task['max_new_tokens']}: the longest prompt ({min(max(task['context_lengths']), limit)} "
                          f"tokens) plus the generation exceed the model's context window of {window} tokens")
    inputs, resolved = resolved_inputs(task, lambda: load_tokenizer(plain["model"], source))
    resolved["context_window"] = window  # tasks that fit prompt + generation to it (InfiniteBench)
    for key, cls in (("method_source_sha256", type(method)), ("scorer_source_sha256", type(getattr(method, "scorer", None))),
                     ("task_source_sha256", tasks.get_task_class(name))):
        if cls.__module__.split(".")[0] not in ("methods", "builtins", "eval"):  # an edited plugin is a new job
            inputs[key] = methods.source_sha256(cls)
    if plain["method"]["name"] == methods.PLUGIN:  # its class names the folder and the report's row
        preset = type(method).__name__ if preset in (None, methods.PLUGIN) else preset
        plain["method"]["label"] = plain["method"].get("label") or type(method).__name__  # its name in reports
    ident = identity(plain, source, inputs, device_type(top.device))
    return JobSpec(plain, top, method, source, layout, inputs, resolved, artifacts.files_read(), ident,
                   job_relpath(plain, preset, ident))
