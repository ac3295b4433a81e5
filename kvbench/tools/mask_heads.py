"""``kvbench mask-heads``: the head-masking ablation of CompressKV Table 2a (Sec. 4.3), the causal test of Wu et al.
(2025): NIAH with chosen query heads silenced (:class:`HeadMask`).

The heads, the random control, the masking modes and the output files: docs/COMPRESSKV.md.
"""

import json
import sys
import time
from pathlib import Path
from typing import Iterable

import torch

from eval.base import TaskConfigError
from methods.artifacts import artifact_path, keyed_errors, load_head_scores, top_heads
from methods.base import ConfigError, HeadLayout

from kvbench.cli import ArgParser, listof, parse_with_overrides
from kvbench.engine import models
from kvbench.job.config import check, compose, conf_model
from kvbench.job.run import build_task, environment, run_sample, set_threads
from kvbench.job.store import atomic_write

KINDS = ("srh", "trh", "random")
MODES = ("zero", "uniform")
PHASES = ("all", "decode")
_SCORE_KIND = {"srh": "semantic_retrieval_heads", "trh": "retrieval_heads"}


class HeadMask:
    """Silences the ``(layer, query head)`` pairs ``heads`` of ``model`` inside a ``with`` block by forward hooks on
    columns ``[h·d, (h+1)·d)`` of the attention's projections ``(B, q, H_q·d)`` (docs/COMPRESSKV.md): ``mode`` ``zero``
    the head's output before W_O, ``uniform`` its query (it attends uniformly); ``phase`` ``all`` every position,
    ``decode`` only those that yield a token (the last prompt position, the decoded ones). ConfigError: an unknown
    mode or phase, a head outside ``layout``, or (on entering) a layer without ``q_proj``/``o_proj`` of H_q·d."""

    def __init__(self, model: torch.nn.Module, layout: HeadLayout, heads: Iterable[tuple[int, int]],
                 mode: str = "zero", phase: str = "all"):
        for key, value, accepted in (("--mode", mode, MODES), ("--phase", phase, PHASES)):
            if value not in accepted:
                raise ConfigError(f"{key}={value!r}: accepted values are {', '.join(accepted)}")
        self.model, self.layout, self.mode, self.phase, self.by_layer, self._handles = model, layout, mode, phase, {}, []
        for layer, head in heads:
            if not (0 <= layer < layout.num_layers and 0 <= head < layout.num_q_heads):
                raise ConfigError(f"head {layer}-{head}: outside the model's {layout.num_layers} layers x "
                                  f"{layout.num_q_heads} query heads")
            self.by_layer.setdefault(int(layer), []).append(int(head))

    def _mask(self, keep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        keep = keep.to(dtype=x.dtype, device=x.device)
        if self.phase == "all" or x.shape[-2] == 1:
            return x * keep
        return torch.cat([x[..., :-1, :], x[..., -1:, :] * keep], -2)  # a prefill: its last row only

    def __enter__(self) -> "HeadMask":
        modules, name = models.attention_modules(self.model), self.layout.model_name or "?"
        h_q, d = self.layout.num_q_heads, self.layout.head_dim
        masks = []  # every layer checked before any hook is registered
        for layer, heads in sorted(self.by_layer.items()):
            proj = getattr(modules.get(layer), "o_proj" if self.mode == "zero" else "q_proj", None)
            if proj is None:
                raise ConfigError(f"model {name}: no attention module with q_proj/o_proj for layer {layer}")
            width = proj.in_features if self.mode == "zero" else proj.out_features
            if width != h_q * d:
                raise ConfigError(f"model {name}: projection width {width} is not {h_q} heads x {d}")
            masks.append((proj, torch.ones(h_q, d).index_fill_(0, torch.tensor(heads), 0.0).flatten()))
        self._handles = [
            proj.register_forward_pre_hook(lambda m, args, k=keep: (self._mask(k, args[0]), *args[1:]))
            if self.mode == "zero" else proj.register_forward_hook(lambda m, args, out, k=keep: self._mask(k, out))
            for proj, keep in masks]
        return self

    def __exit__(self, *exc) -> None:
        while self._handles:
            self._handles.pop().remove()


def random_heads(num_layers: int, num_heads: int, k: int, seed: int, exclude: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """k distinct ``(layer, head)`` pairs outside ``exclude`` from one seeded permutation of all L·H_q
    heads (a larger k extends a smaller one); ConfigError when fewer are left."""
    order = torch.randperm(num_layers * num_heads, generator=torch.Generator().manual_seed(seed)).tolist()
    pool = [(i // num_heads, i % num_heads) for i in order if (i // num_heads, i % num_heads) not in exclude]
    if len(pool) < k:
        raise ConfigError(f"--k={k}: only {len(pool)} heads are left outside the SRH/TRH top-{k} for the random control")
    return pool[:k]


def conditions(scores: dict, ks: list[int], kinds: list[str], seed: int) -> list[dict]:
    """``[{"kind", "k", "heads": [[layer, head], ...]}]``: for each k, the top-k heads of each
    ``scores`` kind (``(L, H_q)`` means), then the random control. ConfigError: k > L·H_q."""
    grid, out = tuple(next(iter(scores.values())).shape), []
    for k in ks:
        chosen = {kind: top_heads(scores[kind], k, "--k", lowest=1) for kind in ("srh", "trh") if kind in kinds}
        out += [{"kind": kind, "k": k, "heads": [list(h) for h in heads]} for kind, heads in chosen.items()]
        if "random" in kinds:
            exclude = {h for heads in chosen.values() for h in heads}
            out.append({"kind": "random", "k": k, "heads": [list(h) for h in random_heads(*grid, k, seed, exclude)]})
    return out


def table_rows(report: dict) -> list[dict]:
    """The no-mask row, then one row per (kind, k): masked score and drop (no-mask − masked, points)."""
    base, score = report["no_mask"], report["no_mask"]["score"]
    return [{"kind": c.get("kind", "none"), "k": c.get("k", 0), "score": c["score"],
             "drop": 0.0 if c is base else None if None in (score, c["score"]) else round(score - c["score"], 2),
             "n": c["n"], "failed": c["failed"]} for c in [base, *report["conditions"]]]


def render_markdown(report: dict) -> str:
    """Table 2a's layout: a row per head kind, a column per top-k; cells ``drop (masked score)``."""
    cell = {(r["kind"], r["k"]): r for r in table_rows(report)[1:]}
    ks = sorted({k for _, k in cell})
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"NIAH score without mask: {fmt(report['no_mask']['score'])} ({report['no_mask']['n']} samples); "
             f"model {report['model']}, mask mode {report['mode']}, phase {report['phase']}", "",
             "| heads | " + " | ".join(f"top-{k}" for k in ks) + " |", "|---|" + "---:|" * len(ks)]
    for kind in (k for k in KINDS if any(c == k for c, _ in cell)):
        cells = [f"{fmt(cell[kind, k]['drop'])} ({fmt(cell[kind, k]['score'])})" if (kind, k) in cell else "-" for k in ks]
        lines.append(f"| {kind if kind == 'random' else kind.upper()} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: drop of the NIAH score in points (score with the heads masked)."]
    heads = {(c["kind"], c["k"]): {tuple(h) for h in c.get("heads", [])} for c in report["conditions"]}
    shared = [f"{len(heads['srh', k] & heads['trh', k])}/{k}" for k in ks if ("srh", k) in heads and ("trh", k) in heads]
    lines += [f"SRH and TRH top-k share {', '.join(shared)} heads."] * bool(shared)
    return "\n".join(lines) + "\n"


def out_stem(out: str, name: str) -> Path:
    """Where ``--out`` puts the files: ``out/name`` for a folder, else ``out`` less its ``.json/.csv/.md`` suffix."""
    return Path(out).parent / Path(out).stem if Path(out).suffix in (".json", ".csv", ".md") else Path(out) / name


def write_report(stem: Path, report: dict) -> list[Path]:
    """Write ``stem.json``, ``stem.csv`` and ``stem.md`` (atomically, each); returns their paths."""
    import pandas as pd

    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.parent / (stem.name + suffix) for suffix in (".json", ".csv", ".md")]  # names may hold dots
    texts = [json.dumps(report, indent=2, ensure_ascii=False) + "\n",
             pd.DataFrame(table_rows(report)).to_csv(index=False, lineterminator="\n"), render_markdown(report)]
    for path, text in zip(paths, texts):
        atomic_write(path, text)
    return paths


def run(args) -> int:
    """Check every input, then load the model and run the no-mask and masked NIAH grids."""
    from kvbench.engine.generate import Engine  # torch._dynamo: imported once the flags are read

    conf_model(args.model)  # --model names a conf/model file
    files = {kind: artifact_path(_SCORE_KIND[kind], args.model, getattr(args, f"{kind}_scores"), f"--{kind}-scores")
             for kind in ("srh", "trh") if kind in args.kinds}  # the published llama31/mistral files: no SRH scores
    def read(kind: str, layout: HeadLayout | None = None):  # a score file's errors name its flag
        with keyed_errors(f"--{kind}-scores", files[kind]):
            return load_head_scores(files[kind], layout)
    plan = conditions({kind: read(kind) for kind in files}, args.k, args.kinds, args.seed)
    # the NIAH job (method full) of --model and the Hydra overrides
    spec = check(compose([f"model={args.model}", "task=niah", "method=full", "threads=null", *args.overrides]))
    for kind in files:  # the score grids must be the model's layers x query heads
        read(kind, spec.method.layout)
    t0 = time.time()
    set_threads(spec.top.threads)
    loaded = models.load_model(spec.cfg["model"], spec.top.device, spec.source, spec.method.layout)  # no window check
    task, samples = build_task(spec.cfg, loaded, spec.resolved)  # (the job's: prompts are the lengths asked for)
    engine, task_cfg = Engine(loaded, spec.method, budget=1.0), spec.cfg["task"]
    report = {
        "model": args.model, "mode": args.mode, "phase": args.phase, "k": args.k, "kinds": args.kinds,
        "seed": args.seed, "score_files": {k: str(p) for k, p in files.items()},
        "grid": {"context_lengths": task_cfg["context_lengths"], "depth_percents": task_cfg["depth_percents"],
                 "haystack_source": getattr(task, "haystack_source", None), "samples": len(samples),
                 "skipped": getattr(task, "skipped", [])},
        "env": environment(loaded), "no_mask": None, "conditions": []}
    for cond in [{"kind": "no mask", "k": 0, "heads": []}] + plan:  # score: 100 x mean ROUGE-1 recall of the ok
        with HeadMask(loaded.model, loaded.layout, [tuple(h) for h in cond["heads"]], args.mode, args.phase):
            runs = [run_sample(engine, loaded, task, sample) for sample in samples]
        records = [{k: r[k] for k in ("id", "prediction", "score", "error") if k != "error" or r[k]} for r in runs]
        ok = [r["score"] for r in records if r["score"] is not None]
        result = {"score": round(100 * sum(ok) / len(ok), 2) if ok else None, "n": len(ok),
                  "failed": len(records) - len(ok), "samples": records}
        report["conditions"] += [{**cond, **result}] if cond["heads"] else []
        report["no_mask"] = report["no_mask"] or result
        print(f"[{time.time() - t0:6.0f}s] {cond['kind']} top-{cond['k']}: {result['score']}", file=sys.stderr, flush=True)
    report["seconds"], report["cpu_seconds"] = round(time.time() - t0, 1), round(time.process_time(), 1)
    written = write_report(out_stem(args.out, f"mask_heads_{args.model}_{args.mode}-{args.phase}"), report)
    print(render_markdown(report))
    print(f"wrote {', '.join(map(str, written))} in {report['seconds']} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the ablation. Returns 0; exit 2 on a user error (one line on stderr)."""
    p = ArgParser(prog="kvbench mask-heads", description=__doc__.split("\n\n")[0])
    lst = dict(nargs="+", action="extend")  # "--k 10 20", "--k 10,20" and "--k 10 --k 20" alike
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the NIAH job (task=niah method=full), e.g. "
                   "task.context_lengths=[512,1024] task.depth_percents=[50] model.source=DIR device=cpu threads=1")
    p.add_argument("--model", default="smollm2", help="conf/model/<name>.yaml; also names methods/artifacts/<name>/")
    p.add_argument("--k", **lst, type=listof(int, lambda k: k >= 1), default=[],
                   help="numbers of top heads to mask, distinct (default 10,20,30)")
    p.add_argument("--kinds", **lst, type=listof(str, KINDS.__contains__, ", ".join(KINDS)), default=[],
                   help=f"head rankings among {', '.join(KINDS)}, at least one of srh, trh (default all)")
    p.add_argument("--srh-scores", default=None, help="SRH head-score file (default methods/artifacts/<model>/semantic_retrieval_heads.json)")
    p.add_argument("--trh-scores", default=None, help="TRH head-score file (default methods/artifacts/<model>/retrieval_heads.json or the published one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-heads control")
    p.add_argument("--mode", choices=MODES, default="uniform", help="uniform (default, Wu et al.'s code): query set to 0; zero: head output before W_O set to 0")
    p.add_argument("--phase", choices=PHASES, default="decode", help="decode (default, Wu et al.'s code): the last prompt position and decoded tokens; all: every position")
    p.add_argument("--out", default="results/mask_heads", help="output folder, or NAME.json/.csv/.md for the three files")
    args = parse_with_overrides(p, argv)
    args.k, args.kinds = sum(args.k or [], []) or [10, 20, 30], sum(args.kinds or [], []) or list(KINDS)
    if len(set(args.k)) != len(args.k):
        p.error(f"--k={args.k}: must be distinct positive integers (e.g. 10,20,30)")
    if not set(args.kinds) & {"srh", "trh"}:
        p.error(f"--kinds={args.kinds}: at least one of srh, trh")
    try:
        return run(args)
    except (ConfigError, TaskConfigError) as e:  # naming the flag or the key
        p.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
