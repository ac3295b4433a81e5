"""The per-sample loop of a job (docs/ARCHITECTURE.md, steps 6 to 8): a unit of samples sharing a context is
prefilled and compressed once (docs/DECODING.md); each answer decoded from it is stored as one record."""

from __future__ import annotations

import gc
import hashlib
import logging
import math
import sys
import time
import traceback
from typing import Any, Iterator

from eval.base import Sample, Task

from kvbench.job.prompts import split_prompt, stop_ids_for
from kvbench.job.store import JobStore

log = logging.getLogger("kvbench")
LOG_EVERY_S = 60.0  # in a log file: a line per sample, at most one a minute, and a sign of life during a long one


def record_ids(sample: Sample, sampling: Any) -> list[str]:
    """The records a sample stores: its id, or with sampling (temperature > 0) ``<id>#<k>`` for each candidate k."""
    return [f"{sample.id}#{k}" for k in range(sampling.n)] if getattr(sampling, "temperature", 0) else [sample.id]


def candidate_seed(seed: int, sample_id: str, k: int) -> int:
    """The seed of candidate k of a sample, of (seed, sample id, k) alone: each candidate resumes on its own."""
    return int(hashlib.sha256(f"{seed}:{sample_id}:{k}".encode()).hexdigest()[:15], 16)


def conversations(samples: list[Sample]) -> list[list[Sample]]:
    """The samples as a job shards and caps them (``shard.*``, ``max_samples``): the samples of a ``group`` (a
    conversation, a SCBench row's questions) count as one, in turn order; every other sample alone."""
    out: dict[Any, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.group or ("one", s.id), []).append(s)
    return [sorted(c, key=lambda s: s.turn) for c in out.values()]


def units(loaded: Any, samples: list[Sample], compress: str) -> list[list[Sample]]:
    """The samples in units, in order of first appearance: a conversation (``follow_up`` samples) in turn order;
    under ``compress=context`` the samples of equal context ids; else one sample each."""
    turned = {s.group for s in samples if s.follow_up}
    out: dict[Any, list[Sample]] = {}
    for s in samples:
        if s.group and s.group in turned:
            key = ("turns", s.group)
        elif compress == "context":
            ids, q = split_prompt(loaded, s, compress)
            key = ("context", hashlib.sha256(str(ids[: len(ids) - q]).encode()).hexdigest())
        else:
            key = ("one", s.id)
        out.setdefault(key, []).append(s)
    return [sorted(u, key=lambda s: s.turn) if k[0] == "turns" else u for k, u in out.items()]


def failed(sample_id: str, err: BaseException) -> dict[str, Any]:
    """Log a failed sample in one line naming its traceback's last frame; return its records' error fields."""
    frames = traceback.extract_tb(err.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    log.error("sample %s failed: %s: %s (at %s)", sample_id, type(err).__name__, err, where)
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    return {"prediction": None, "score": None, "error": {"type": type(err).__name__, "message": str(err)[:2000],
                                                         "where": where, "traceback": text[-20000:]}}


def free_cuda() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()  # a no-op before CUDA is initialized


def scored(task: Task, sample: Sample, result: Any, base: dict) -> dict[str, Any]:
    """The record of one answer, scored (FloatingPointError: not finite), with the engine's measurements."""
    score = float(task.score(sample, result.text))
    if not math.isfinite(score):
        raise FloatingPointError(f"non-finite score {score!r}")
    extra = task.extra_scores(sample, result.text) if hasattr(task, "extra_scores") else {}
    return {**base, "prediction": result.text, "score": score, "scores": extra, **result.record(), "error": None}


class Unit:
    """One unit (:func:`units`) run by one engine: its context opened once, then each record not in ``done`` answered;
    ``sampling``: the job's node (None: greedy)."""

    def __init__(self, engine: Any, loaded: Any, task: Task, samples: list[Sample], done: set[str], sampling: Any,
                 seed: int):
        self.engine, self.loaded, self.task, self.samples = engine, loaded, task, samples
        self.done, self.sampling, self.seed = done, sampling, seed
        self.turns = any(s.follow_up for s in samples)
        self.shared = len(samples) > 1 or self.turns
        self.group, self.opened = "", 0

    def missing(self, sample: Sample) -> list[int]:
        return [k for k, rid in enumerate(record_ids(sample, self.sampling)) if rid not in self.done]

    def run(self, on_record, part: Any = None, batched: bool = False) -> Iterator[Any]:
        """Answer every missing record into ``on_record(record)``. ``part``: this engine's share of a shared
        prefill (:func:`kvbench.engine.generate.prefill`), its error, or None. ``batched``: yield the answers as rows
        of a decode batch (:meth:`kvbench.engine.generate.Engine.decode_rows`; each on its own fork), a row's
        ``tag(result)`` storing its record. Raises only submitit's preemption: an error becomes the records' (a
        conversation's later turns' too)."""
        from kvbench.engine.generate import Row

        ctx, start, cut = None, None, False
        for i, sample in enumerate(self.samples):
            want = self.missing(sample)
            if self.turns and not any(self.missing(s) for s in self.samples[i:]):
                break
            if not want and not self.turns:
                continue
            try:
                if isinstance(part, BaseException):
                    raise part
                if sample.follow_up:  # the segment on top of the conversation so far
                    eos = getattr(self.loaded.tokenizer, "eos_token_id", None)  # SCBench's GreedySearch: an own
                    extra = [eos] if cut and eos is not None else []  # answer cut by the limit gets an eos first
                    self.engine.feed(ctx, extra + self.loaded.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"])
                else:
                    ids, q = split_prompt(self.loaded, sample, self.task.cfg.get("compress", "prompt"))
                    c = len(ids) - q
                    if ctx is None:
                        ctx, self.opened = self.engine.open(ids[:c], sample.max_new_tokens + q, part), 1
                        self.group = sample.group or hashlib.sha256(str(ids[:c]).encode()).hexdigest()[:12]
                        start = self.engine.checkpoint(ctx) if self.shared and not (self.turns or batched) else None
                    elif start is not None:  # each question starts from the context
                        self.engine.restore(ctx, start)
                    mine = self.engine.fork(ctx) if batched and len(self.samples) > 1 else ctx
                    self.engine.feed(mine, ids[c:])
                question = self.engine.checkpoint(ctx) if not batched and (len(want) > 1 or self.turns) else None
                result = None
                for n, k in enumerate(want if want or not sample.keep_answer else [None]):  # an own answer stays
                    if batched:
                        yield Row(self.engine.fork(mine) if n < len(want) - 1 else mine, sample.max_new_tokens,
                                  stop_ids_for(self.loaded, sample), sample.min_new_tokens, self.generator(sample, k),
                                  lambda result, sample=sample, k=k: self.fail(result, on_record, [(sample, [k])])
                                  if isinstance(result, BaseException) else on_record(self.record(sample, k, result)))
                        self.done.add(record_ids(sample, self.sampling)[k])  # its row stores it, a later failure not
                        continue
                    if n:
                        self.engine.restore(ctx, question)
                    result = self.engine.decode(ctx, sample.max_new_tokens, stop_ids_for(self.loaded, sample),
                                                sample.min_new_tokens, self.generator(sample, k), self.sampling)
                    if k is not None:
                        on_record(self.record(sample, k, result))
                        self.done.add(record_ids(sample, self.sampling)[k])
                if self.turns and not sample.keep_answer:  # golden history: the answer leaves the cache
                    self.engine.restore(ctx, question)
                cut = result is not None and sample.keep_answer and result.generated_tokens >= sample.max_new_tokens
            except Exception as e:  # noqa: BLE001 - per-sample isolation is the point
                if type(e).__name__ == "UncompletedJobError":
                    raise  # submitit's preemption signal: the task must stop and be requeued
                later = [(s, self.missing(s)) for s in self.samples[i + 1 :]] if self.turns else []
                self.fail(e, on_record, [(sample, self.missing(sample)), *later])  # stored or sent: not again
                if self.turns:
                    break
                part = part if isinstance(part, BaseException) else None

    def generator(self, sample: Sample, k: int | None) -> Any:
        import torch

        if k is None or not getattr(self.sampling, "temperature", 0):
            return None
        return torch.Generator(device=self.loaded.device).manual_seed(candidate_seed(self.seed, sample.id, k))

    def fail(self, err: BaseException, on_record, todo: list[tuple[Sample, list[int]]]) -> None:
        error = failed(todo[0][0].id, err)
        free_cuda()
        for sample, want in todo:
            for k in want:
                on_record({**self.base(sample, k), **error})

    def base(self, sample: Sample, k: int) -> dict[str, Any]:
        base = {"id": sample.id, "dataset": sample.dataset, "answers": sample.answers,
                "all_classes": sample.all_classes, "length": sample.length, "meta": sample.meta,
                "prompt_sha256": hashlib.sha256(sample.prompt.encode()).hexdigest()}
        if getattr(self.sampling, "temperature", 0):
            base.update(id=f"{sample.id}#{k}", problem=sample.id, candidate=k)
        if self.shared:
            base.update(group=self.group or sample.group, turn=sample.turn, group_compressions=self.opened)
        return base

    def record(self, sample: Sample, k: int, result: Any) -> dict[str, Any]:
        base = self.base(sample, k)
        try:
            return scored(self.task, sample, result, base)
        except Exception as e:  # noqa: BLE001
            return {**base, **failed(base["id"], e)}


class Progress:
    """Progress of a job's samples: on a terminal a tqdm bar; in a log file (SLURM, nohup) a line as the first prefill
    starts, then a line per sample or a sign of life in a long generation at most once a minute (and the last). Each
    carries done/total, each job's mean over its stored records (resumed ones too; by job folder) and an eta."""

    def __init__(self, total: int, stores: list[JobStore], quiet: bool):
        from tqdm import tqdm

        self.total, self.done, self.quiet, self.interactive = total, 0, quiet, sys.stderr.isatty()
        self.scores = [[100 * r["score"] for r in s.latest().values() if r.get("error") is None and r.get("score") is not None]
                       for s in stores]
        self.labels = ["/".join(s.path.parts[-2:]) + " " if len(stores) > 1 else "" for s in stores]
        self.bar = tqdm(total=total, desc="samples", unit="sample", disable=quiet or not self.interactive)
        self.t0 = self.last = time.monotonic()

    def means(self) -> str:
        return ", ".join(f"{label}{sum(v) / len(v):.2f}" if v else f"{label}-" for label, v in zip(self.labels, self.scores))

    def scored(self, j: int, record: dict) -> None:
        if record.get("error") is None:
            self.scores[j].append(100 * record["score"])

    def _line(self, n: int, what: str, now: bool = False) -> None:  # about sample n: at once when now
        if not (self.quiet or self.interactive) and (now or time.monotonic() - self.last >= LOG_EVERY_S):
            self.last = time.monotonic()
            left = (self.last - self.t0) / max(self.done, 1) * (self.total - self.done)
            eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left < 86400 else f"{left / 86400:.1f}d"
            log.info("sample %d/%d%s; mean %s, eta %s", n, self.total, what, self.means(), eta if self.done else "?")

    def step(self, generated: int) -> None:
        """A decode step of the current sample (``Engine.on_decode_step``): a sign of life in a log file."""
        self._line(self.done + 1, f": generating, {generated} tokens so far")

    def starting(self, sample: Sample) -> None:
        """A unit's prefill begins: a line for the first one (model load to first answer is silent otherwise)."""
        self._line(self.done + 1, f" {sample.id}: prefilling", now=not self.done)

    def sample_done(self, sample: Sample, outcomes: list[str]) -> None:
        self.done += 1
        self.bar.set_postfix(mean_score=self.means(), refresh=False)
        self.bar.update(1)
        self._line(self.done, f" {sample.id}: {', '.join(outcomes)}", now=self.done == self.total)


def run_samples(engines: list[Any], loaded: Any, task: Task, samples: list[Sample], stores: list[JobStore], quiet: bool,
                sampling: Any = None, seed: int = 0, batch_size: int | str = 1, max_bytes: int | None = None) -> None:
    """Run every unit (:func:`units`) for each (engine, store) that lacks some of it: one prefill of its context for
    all (:func:`kvbench.engine.generate.prefill`), each engine's answers (:class:`Unit`) appended to its store."""
    from kvbench.engine.generate import prefill

    done = [store.done_ids() for store in stores]
    compress = task.cfg.get("compress", "prompt")
    todo = [u for u in units(loaded, samples, compress)
            if any(rid not in d for d in done for s in u for rid in record_ids(s, sampling))]
    progress = Progress(sum(map(len, todo)), stores, quiet)
    pending: dict[str, tuple[Sample, int, list[str]]] = {}  # by sample id: it, its records to come, their outcomes

    def on_record(j: int, rec: dict) -> None:
        try:
            stores[j].append(rec)
        except (TypeError, ValueError) as e:  # not strict JSON (a NaN): store the failure instead
            rec = {k: rec.get(k) for k in ("id", "dataset", "answers", "all_classes", "length")} | failed(rec["id"], e)
            stores[j].append(rec)
        progress.scored(j, rec)
        sample, n, outcomes = pending[rec.get("problem", rec["id"])]
        outcomes.append(progress.labels[j] + (f"score {100 * rec['score']:.2f}" if rec["error"] is None
                                              else f"failed ({rec['error']['type']})"))
        if len(outcomes) == n:
            progress.sample_done(sample, outcomes)

    for engine in engines:
        engine.on_decode_step = progress.step
    batched: list[Unit] = []  # batch_size > 1 or auto (rows up to max_bytes): decoded together at the end
    try:
        for unit in todo:
            progress.starting(unit[0])
            runs = [Unit(engines[j], loaded, task, unit, done[j], sampling, seed) for j in range(len(engines))]
            mine = [j for j, r in enumerate(runs) if any(r.missing(s) for s in unit)]
            for s in unit:
                pending[s.id] = (s, sum(len(runs[j].missing(s)) for j in mine), [])
                if not pending[s.id][1]:  # nothing to store for it (a done turn)
                    progress.sample_done(s, ["stored before"])
            if batch_size != 1 and len(engines) == 1 and not runs[0].turns:
                batched.append(runs[0])
                continue
            first = next(s for s in unit if any(runs[j].missing(s) for j in mine) or s.turn == 0)
            try:  # the context's ids (task.compress=context: without the query part), room for the rest
                ids, q = split_prompt(loaded, first, compress) if len(mine) > 1 else ([], 0)
                parts = [None] if len(mine) == 1 else prefill(
                    [engines[j] for j in mine], ids[: len(ids) - q], first.max_new_tokens + q)
            except Exception as e:  # noqa: BLE001 - every variant of this unit stores the error
                parts = [e] * len(mine)
            for j, part in zip(mine, parts):
                list(runs[j].run(lambda rec, j=j: on_record(j, rec), part))  # decodes as it goes: yields nothing
        if batched:
            rows = (row for run in batched for row in run.run(lambda rec: on_record(0, rec), batched=True))
            engines[0].decode_rows(rows, batch_size, sampling, lambda row, result: row.tag(result), max_bytes)
    finally:
        progress.bar.close()
        for engine in engines:
            engine.on_decode_step = None


def run_sample(engine: Any, loaded: Any, task: Task, sample: Sample) -> dict[str, Any]:
    """Generate and score one sample alone (greedy) and return its record; never raises (an error becomes the
    record's ``error``)."""
    records: list[dict] = []
    list(Unit(engine, loaded, task, [sample], set(), None, 0).run(records.append))
    return records[0]
