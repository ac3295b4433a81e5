"""Job configuration: the schemas and :func:`check` (docs/ARCHITECTURE.md, step 2); the job folder: docs/RESULTS.md."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
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
FORMER = {("model", "compress_sliding_layers"): False, ("method", "score_dtype"): "float32", ("task", "compress"): "prompt",
          ("task", "max_total_tokens"): None, ("method", "per_query_head"): False}
DTYPES = ("float32", "bfloat16", "float16")
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def need(ok: Any, key: str, value: Any, rule: str) -> None:
    """Unless ``ok``, ConfigError ``<key>=<value>: <rule>``: every check names exactly the key it checks."""
    if not ok:
        raise ConfigError(f"{key}={value}: {rule}")


@dataclass
class Shard:
    index: int = 0
    count: int = 1


@dataclass
class Sweep:
    share_prefill: bool = False  # docs/SWEEPS.md: a local sweep's jobs that differ in method and budget share prefills


@dataclass
class Decode:
    interval: int = 0  # compress every `interval` decode steps to `budget` tokens (an integer); 0: at the end of prefill only
    prefill: bool = True  # with interval > 0: compress the prompt at the end of prefill too (false: decode-only)
    schedule: str = "steps"  # steps (kvpress DecodingPress) | length (R-KV: when the tokens fed are a multiple of interval)


@dataclass
class Sampling:
    n: int = 1  # candidates per sample (temperature > 0), each its own record <id>#<k>
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off


@dataclass
class Cache:
    bits: Optional[int] = None  # null: the model dtype; 2, 4, 8: KIVI-quantized (keys per channel, values per token)
    group_size: int = 32  # entries per scale and minimum: tokens of a key channel, channels of a value token
    residual: int = 128  # tokens per quantized block: the last (T mod residual) stay in full precision; 0: group_size
    max_bytes: Optional[float] = None  # batch_size=auto: bytes all rows' caches may hold, e.g. 1e9 (null: CUDA's free)

    def __post_init__(self):
        need(self.bits in (None, 2, 4, 8), "cache.bits", self.bits, "accepted values are null (the model dtype), 2, 4, 8")
        need(self.group_size >= 1, "cache.group_size", self.group_size, "must be an integer >= 1 (it divides the head dim)")
        need(self.max_bytes is None or self.max_bytes >= 1, "cache.max_bytes", self.max_bytes, "must be null or >= 1")
        need(self.residual >= 0, "cache.residual", self.residual, "must be an integer >= 0 (0: cache.group_size)")
        key = "group_size" if self.residual == Cache.residual else "residual"  # the one set: the default is right
        rule = (f"must divide cache.residual={self.residual}" if key == "group_size" else
                f"must be 0 or a multiple of cache.group_size={self.group_size}")
        need(not self.residual % self.group_size, f"cache.{key}", getattr(self, key), f"{rule} (keys are quantized in "
             "whole groups of tokens)")


@dataclass
class TopConfig:
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
    batch_size: Any = 1  # answers decoded together (docs/DECODING.md); not in the identity: results equal batch 1's
    per_model: Any = None  # experiment presets: per-model helper tables for interpolations
    latency: Any = None  # the latency benchmark's node (conf/experiment/selkv_fig3*.yaml)

    def __post_init__(self):
        self.budget = check_budget(self.budget)
        cores, d, s, sh = 4 * (os.cpu_count() or 1), self.decode, self.sampling, self.shard
        need(-2**63 <= self.seed < 2**64, "seed", self.seed, "must be an integer from -2**63 to 2**64 - 1 (torch.manual_seed's range)")
        need(self.device in ("auto", "cpu", "cuda", "mps") or (self.device.startswith("cuda:") and self.device[5:].isdigit()),
             "device", self.device, "accepted values are auto, cpu, cuda, cuda:<index>, mps")
        need(self.max_samples is None or self.max_samples >= 1, "max_samples", self.max_samples, "must be an integer >= 1 or null")
        need(sh.count >= 1, "shard.count", sh.count, "must be an integer >= 1")
        need(0 <= sh.index < sh.count, "shard.index", sh.index, f"must be from 0 to shard.count - 1 ({sh.count - 1})")
        need(self.lock_wait_s >= 0, "lock_wait_s", self.lock_wait_s, "must be a number of seconds >= 0")
        need(self.threads in ("auto", None) or (isinstance(self.threads, int) and 1 <= self.threads <= cores), "threads",
             self.threads, f"accepted values are auto, null or an integer from 1 to {cores} (4 x this machine's cores)")
        need(self.compile in ("auto", True, False), "compile", self.compile, "accepted values are auto, true, false")
        need(self.batch_size == "auto" or type(self.batch_size) is int and self.batch_size >= 1, "batch_size",
             self.batch_size, "must be auto or an integer >= 1 (1: each answer alone)")
        need(d.interval >= 0, "decode.interval", d.interval, "must be an integer >= 0 (0: off)")
        need(d.schedule in ("steps", "length"), "decode.schedule", d.schedule, "accepted values are steps, length")
        need(not d.interval or self.compile is not True, "decode.interval", d.interval, "needs eager decoding (compile=false or auto)")
        need(d.prefill or d.interval, "decode.prefill", d.prefill, "decode-only compression needs decode.interval > 0")
        need(s.temperature >= 0, "sampling.temperature", s.temperature, "must be a number >= 0 (0: greedy)")
        need(s.n >= 1 and (s.n == 1 or s.temperature), "sampling.n", s.n, "must be >= 1 (> 1 only with sampling.temperature > 0)")
        need(0 < s.top_p <= 1, "sampling.top_p", s.top_p, "must be a number with 0 < top_p <= 1")
        need(s.top_k >= 0, "sampling.top_k", s.top_k, "must be an integer >= 0 (0: off)")
        root = Path(str(self.output_root)).expanduser().absolute()
        need(str(self.output_root).strip() and next(p for p in (root, *root.parents) if p.exists()).is_dir(), "output_root",
             repr(self.output_root), "must name a folder for the results, not a file or a path under one (default: results)")
        need(self.run_tag is None or ("/" not in str(self.run_tag) and str(self.run_tag).strip()), "run_tag", self.run_tag,
             "must be a non-empty name without '/' (a suffix of the job folder)")
        need(self.run_name is None or not (Path(self.run_name).is_absolute() or ".." in Path(self.run_name).parts
                                           or not self.run_name.strip()), "run_name", self.run_name,
             "must be a relative folder path inside output_root (no '..')")


@dataclass
class ModelConfig:
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
        need(self.chat_template in (True, False, "none", *CHAT_FORMATS), "model.chat_template", self.chat_template,
             f"accepted values are true (the tokenizer's template), {', '.join(CHAT_FORMATS)}, none")
        need(self.tokenizer in ("fast", "slow"), "model.tokenizer", self.tokenizer, "accepted values are fast, slow")
        need(self.gguf_cache in ("auto", True, False), "model.gguf_cache", self.gguf_cache, "accepted values are auto, true, false")
        for dev, name in self.dtype.items():
            need(name in DTYPES, f"model.dtype.{dev}", name, f"accepted values are {', '.join(DTYPES)}")
        need(self.max_input_length >= 2, "model.max_input_length", self.max_input_length, "must be an integer >= 2 (tokens)")
        need(all(isinstance(t, str) for t in self.stop_tokens), "model.stop_tokens", self.stop_tokens,
             "must be a list of token strings, e.g. ['<|im_end|>']")
        need(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_ids), "model.stop_ids",
             self.stop_ids, "must be a list of token ids (integers >= 0)")
        dm = self.device_map
        need(dm is None or isinstance(dm, dict) or dm in DEVICE_MAPS or dm == "cpu" or (isinstance(dm, int) and dm >= 0)
             or (isinstance(dm, str) and dm.startswith("cuda")), "model.device_map", dm, f"accepted values are null, "
             f"{', '.join(DEVICE_MAPS)}, a device (cpu, cuda, cuda:1, a GPU index) or a mapping of module names to devices")


def conf_model(name: str, key: str = "--model") -> dict:
    """``conf/model/<name>.yaml`` (or a YAML path) as a dict with the schema's defaults (the tools' ``--model``)."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else CONF_MODEL_DIR / f"{name}.yaml"
    need(path.is_file(), key, repr(name), "no such model config; accepted values are "
         + ", ".join(sorted(p.stem for p in CONF_MODEL_DIR.glob("*.yaml"))))
    node = {k: v for k, v in yaml.safe_load(path.read_text(encoding="utf-8")).items() if k != "defaults"}
    return asdict(structured(ModelConfig, node, "model."))


def register() -> None:
    """Store the schemas that ``conf/`` extends in Hydra's ConfigStore (``hydra_plugins/kvbench_launcher``)."""
    store = ConfigStore.instance()
    store.store(name="kvbench", node=TopConfig)
    store.store(group="schema", name="model", node=ModelConfig)
    for name in methods.available():
        store.store(group="schema/method", name=name, node=methods.schema(name))
    # not struct: method.<field>= of the class's Config, checked by methods.build_method
    plugin = OmegaConf.create({"name": methods.PLUGIN, "label": None, "target": "???"}, flags={"struct": False})
    store.store(group="schema/method", name=methods.PLUGIN, node=plugin)
    for name in tasks.available():
        store.store(group="schema/task", name=name, node=tasks.get_task_class(name).Config)


def compose(overrides: list[str], **kw: Any) -> Any:
    """``conf/config.yaml`` composed by Hydra with ``overrides`` (``kw``: of ``hydra.compose``). ConfigError: an
    override Hydra or a schema refuses, worded by :func:`one_line`."""
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose("config", overrides, **kw)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(one_line(e, overrides)) from None


def one_line(e: BaseException, args: list[str]) -> str:
    """A Hydra / OmegaConf / kvbench configuration error as one line naming the key (``args``: the overrides given),
    control characters escaped: what ``python run.py`` prints and :func:`compose`'s ConfigError says."""
    line = re.sub(r" To append to your config use \S+", "", " ".join(str(e).split())).split(" Config search path")[0]
    if "Could not load 'hydra/launcher/joblib'" in line and "pip install" not in line:  # hydra/launcher=parallel without its plugin
        line += ' Install the joblib launcher plugin: pip install -e ".[sweeps]" (hydra-joblib-launcher)'
    cause, parent = e.__cause__, getattr(e.__cause__, "parent_node", None)
    if "not in" in str(cause) and parent is not None:  # an unknown key, against a schema or a plain node
        line = f"{line.rstrip('.')}: unknown key; " + (f"accepted keys are {', '.join(sorted(parent))}"
                                                       if len(parent) else f"a new key is added with +: +{cause.full_key}=...")
    elif getattr(cause, "full_key", None) and getattr(cause, "msg", None):  # a type or choice the schema refuses
        line = f"{cause.full_key}: {str(cause.msg).splitlines()[0]}"
    if type(e).__name__ == "OverrideParseException":  # name the override Hydra could not parse
        for a in args:
            try:
                OverridesParser.create().parse_override(a)
            except Exception:  # noqa: BLE001
                bad = [c for c in a if not c.isprintable()]
                line = f"{a}: cannot parse this override ({f'control character {bad[0]!r}' if bad else line}); write "
                line += "key=value, see python run.py --help"
                break
    if isinstance(e, ValueError) and "Config group override" in line:  # a group set to a non-option: method=null
        for o in OverridesParser.create().parse_overrides([a for a in args if "=" in a and a[:1] != "-"]):
            if (CONF / o.key_or_group).is_dir() and not o.is_sweep_override() and not isinstance(o.value(), str):
                line = (f"{o.input_line}: {o.key_or_group} is a config group; accepted values are "
                        f"{', '.join(sorted(p.stem for p in (CONF / o.key_or_group).glob('*.yaml')))}")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)


def preset(group: str, name: str) -> dict:
    """``conf/<group>/<name>.yaml`` composed, as a plain dict; a value the user must give (``???``) reads as None."""
    node = OmegaConf.to_container(compose([f"{group}={name}"])[group], enum_to_str=True)
    return OmegaConf.to_container(OmegaConf.create({k: None if v == "???" else v for k, v in node.items()}), resolve=True)


def resolved_inputs(task: dict, tokenizer: Any = None) -> tuple[dict, dict]:
    """``(inputs, resolved)``: the SHA-256 of what the task reads (in the identity; docs/RESULTS.md) and what it
    is built with. TaskConfigError: a haystack or data folder that does not exist or is empty."""
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
    """A job checked once by :func:`check`; nothing downstream re-checks it."""

    cfg: dict  # the plain config (config.yaml); top: its typed top level; method.layout: the model's heads
    top: TopConfig
    method: Any
    source: tuple[str, str | None]
    resolved: dict
    artifacts: dict
    identity: dict
    relpath: str


def identity(cfg: dict, source: tuple[str, str | None], inputs: dict, device: str) -> dict:
    """Every resolved setting that can change a result (docs/RESULTS.md)."""
    def kept(group: str, *out: str) -> dict:  # a FORMER setting at its former value stays out
        return {k: v for k, v in cfg[group].items() if k not in out and FORMER.get((group, k), ...) != v}

    model = kept("model", "name", "gguf_cache", "device_map")
    src = cfg["model"]["source"]  # pypi:<module>==<version>, not its path: any venv is the same model
    dist = src.startswith("pypi") and next(metadata.distributions(name=src.split(":", 1)[1].replace("_", "-")), None)
    model.update(dtype=cfg["model"]["dtype"].get(device, "float32"),
                 source=(f"{src}=={dist.version}" if dist else src) if src.startswith("pypi") else list(source))
    return {
        "model": model,
        "method": kept("method", "label"),
        "task": kept("task", *SELECTION_KEYS, "data_dir", "haystack_dir", "qa_files", "cwe_words"),
        "inputs": inputs,
        "budget": None if cfg["method"]["name"] == "full" else cfg["budget"],
        "seed": cfg["seed"],
        "device": device,
        # only when on (earlier folders resume); sampling.n chooses records, as max_samples does
        **({"decode": cfg["decode"]} if (cfg.get("decode") or {}).get("interval") and cfg["method"]["name"] != "full" else {}),
        **({"sampling": kept("sampling", "n")} if (cfg.get("sampling") or {}).get("temperature") else {}),
        **({"cache": kept("cache", "max_bytes")} if (cfg.get("cache") or {}).get("bits") else {}),
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


def check(cfg: Any, preset: str | None = None) -> JobSpec:
    """The :class:`JobSpec` of a composed config. ConfigError / TaskConfigError: the first problem, one line."""
    import torch
    from methods import artifacts
    from kvbench.engine.models import head_layout, load_tokenizer, read_config, resolve_source

    try:  # Hydra checked keys, types and choices against the schemas (register); their __post_init__ check ranges
        plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        for group in ("model", "method", "task"):
            if not isinstance(plain.get(group), dict):
                raise ConfigError(f"{group}: missing; it is required (see conf/config.yaml)")
        top = OmegaConf.to_object(cfg)
        plain["task"].update(asdict(top.task) if is_dataclass(top.task) else {})  # implied values
    except OmegaConfBaseException as e:  # a missing value, also behind an interpolation (label: ${.press})
        missing = re.search(r"Missing mandatory value: ([\w.]+)", str(e.msg))
        key = missing and (missing[1] if "." in missing[1] else e.full_key)
        raise ConfigError(f"{key}: missing; it is required (docs/METHODS.md)" if missing
                          else f"{e.full_key}: {str(e.msg).splitlines()[0]}") from None
    for prefix, node, given in (("", top, plain), ("model.", top.model, plain["model"]), ("task.", top.task, plain["task"])):
        keys = [f.name for f in fields(node)] if is_dataclass(node) else []  # + passes Hydra
        if keys and set(given) - set(keys):  # (the method's keys: build_method)
            raise ConfigError(f"{prefix}{min(set(given) - set(keys))}: unknown key; accepted keys are {', '.join(keys)}")
    plain["budget"], model = top.budget.value, top.model  # 64.0 is the token budget 64, 0.30000000000000004 the ratio 0.3
    method = methods.build_method(plain["method"])
    if getattr(method.config, "implied_decode", None) and not top.decode.interval:  # kvpress's decoding_* keys
        top.decode = Decode(**method.config.implied_decode)
        plain["decode"] = dict(method.config.implied_decode)
    task, name = plain["task"], str(plain["task"].get("name"))
    tasks.get_task_class(name).validate(task)
    methods.check_min_budget(method, top.budget, bool(top.decode.interval))
    need(not (method.reads and top.compile is True), "compile", "true", f"method {method.name} decodes eager; use "
         "compile=false or auto")
    need(top.decode.interval or not method.decode_only, "decode.interval", 0, f"method {method.name} compresses while "
         "decoding; set decode.interval > 0 (R-KV's run_math.py: 128 with decode.schedule=length)")
    cut = top.decode.interval if method.name != "full" else 0  # the full cache: nothing to cut
    need(not cut or method.decodes, "decode.interval", cut, f"method {plain['method'].get('label')} does not compress "
         "while decoding; accepted methods are the scoring ones (docs/DECODING.md)")
    need(not cut or top.budget.tokens, "decode.interval", cut, f"needs an integer token budget (budget={top.budget})")
    limit = int(task.get("max_length") or model.max_input_length)
    if task.get("max_new_tokens") and name == "niah" and min(task["context_lengths"]) > limit:
        raise TaskConfigError(f"task.context_lengths={task['context_lengths']}: every length exceeds the prompt budget "
                              f"of {limit} tokens (model.max_input_length / task.max_length)")
    source = resolve_source(plain["model"])
    hf_config = read_config(plain["model"], source)  # the layout and context window, without the weights
    method.layout = layout = head_layout(hf_config, model.name, model.compress_sliding_layers)
    bits = top.cache.bits
    need(not bits or not (layout.head_dim % top.cache.group_size or layout.head_dim % (8 // bits)), "cache.group_size",
         top.cache.group_size, f"must divide the model's head dim ({layout.head_dim}, which {bits and 8 // bits} "
         f"{bits}-bit codes per byte must divide too)")
    need(not bits or not method.per_head_lengths, "cache.bits", bits, f"method {method.name} may keep per-head lengths, "
         "which the quantized cache does not store; use a method with one length per layer, or cache.bits=null")
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
    device = ("cuda" if torch.cuda.is_available() else "cpu") if top.device == "auto" else top.device.split(":")[0]
    need(device != "cuda" or top.device == "auto" or int(top.device[5:] or 0) < torch.cuda.device_count(), "device",
         top.device, f"this machine has {torch.cuda.device_count()} CUDA device(s); use device=auto or cpu")
    ident = identity(plain, source, inputs, device)
    need(top.batch_size != "auto" or top.cache.max_bytes or ident["device"] == "cuda", "batch_size", "auto",
         "needs cache.max_bytes off CUDA (on CUDA the cap defaults to the free memory)")
    return JobSpec(plain, top, method, source, resolved, artifacts.files_read(), ident,
                   job_relpath(plain, preset, ident))
