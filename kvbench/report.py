"""``kvbench report RESULTS_ROOT [--out DIR] [--only NAME...] [--latency FILE]``.

Reads every job folder under a results root into one frame (:func:`load_results`) and writes
an overview score table per task × model (``scores_<task>_<model>``: every job configuration
of any sweep) and each of the seed papers' tables and figures whose inputs exist:

* tables as Markdown (``.md``), LaTeX (``.tex``) and CSV (``.csv``): a missing cell is ``–``
  in Markdown, ``--`` in LaTeX and empty in CSV, never zero;
* figures as PNG and PDF with a caption line (model, task, budget semantics);
* for every artifact, ``<name>.sources.txt``: the job folders it was built from and notes on
  absent jobs / datasets; plus ``index.md`` listing what was written and what had no inputs.

Also runnable as ``python -m kvbench.report``. Artifact names: see :data:`ARTIFACTS`
(``--only`` takes names or shell patterns, e.g. ``--only 'selkv_table*' niah``).
"""

from __future__ import annotations

import fnmatch
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd

from . import report_ablations as ra
from . import report_figures as rf
from . import report_tables as rt
from .cli_parser import OneLineParser
from .plots import plt
from .report_data import load_results
from .report_tables import Table, round2
from .signals import quiet_broken_pipe
from .store import store_write_refusal

__all__ = ["ARTIFACTS", "load_results", "load_latency", "build", "write_table", "main"]


DESCRIPTION = ("Write, from the job folders under RESULTS_ROOT, a score table per task and model "
               "(scores_<task>_<model>: every method, variant and budget of any sweep) and each of the seed papers' "
               "tables and figures whose inputs exist; index.md lists what was written and what had no inputs.")


@dataclass
class Context:
    """What artifact builders read: the results root, its frame, latency records (or None)."""

    root: Path
    df: pd.DataFrame
    latency: list[dict] | None
    latency_source: str = ""


# family name -> (builder, output names it may produce: patterns for --only)
ARTIFACTS: dict[str, tuple[Callable[[Context], list], list[str]]] = {
    "scores": (lambda c: rt.score_tables(c.df, c.root), ["scores_*"]),
    "selkv_table1": (lambda c: rt.selkv_table1(c.df), ["selkv_table1"]),
    "selkv_table2": (lambda c: ra.selkv_table2(c.df), ["selkv_table2"]),
    "selkv_table3": (lambda c: ra.selkv_table3(c.df), ["selkv_table3"]),
    "selkv_table4": (lambda c: rt.selkv_table4(c.df), ["selkv_table4"]),
    "selkv_ratio_tables": (lambda c: rt.selkv_ratio_tables(c.df), ["selkv_table5", "selkv_table6", "selkv_ratios_*"]),
    "selkv_table7": (lambda c: rt.selkv_table7(c.df), ["selkv_table7"]),
    "selkv_fig2": (lambda c: rf.selkv_fig2(c.df), ["selkv_fig2"]),
    "selkv_fig3": (lambda c: rf.selkv_fig3(c.latency or [], c.latency_source), ["selkv_fig3"]),
    "selkv_fig4": (lambda c: rf.selkv_fig4(c.df), ["selkv_fig4"]),
    "selkv_fig5": (lambda c: rf.selkv_fig5(c.df), ["selkv_fig5"]),
    "compresskv_table1": (lambda c: rt.compresskv_table1(c.df), ["compresskv_table1"]),
    "compresskv_table3": (lambda c: ra.compresskv_table3a(c.df) + ra.compresskv_table3b(c.df),
                          ["compresskv_table3a", "compresskv_table3b"]),
    "compresskv_fig4": (lambda c: rf.compresskv_fig4(c.df), ["compresskv_fig4"]),
    "compresskv_fig5": (lambda c: rf.compresskv_fig5(c.df), ["compresskv_fig5"]),
    "niah": (lambda c: rf.niah_figures(c.df, c.root), ["niah/*", "niah_panel_*"]),
}


def fmt(value, signed: bool = False) -> str | None:
    """Two decimals, half-up (the papers' rounding); None for a missing (NaN) value."""
    if isinstance(value, str):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    text = f"{round2(float(value)):.2f}"
    return ("+" + text) if signed and round2(float(value)) > 0 else text


def _cells(table: Table) -> list[list[tuple[str | None, bool]]]:
    return [[(fmt(table.data.iat[i, j], col in table.signed), (i, col) in table.bold)
             for j, col in enumerate(table.data.columns)] for i in range(len(table.data))]


def _numeric(table: Table, col: str) -> bool:
    return pd.api.types.is_numeric_dtype(table.data[col])


def _right_aligned(table: Table, col: str) -> bool:
    """Markdown alignment: numeric columns, and text columns holding only integers (a count kept
    as text so that it prints without a decimal point, e.g. the score tables' ``n``)."""
    if _numeric(table, col):
        return True
    present = [v for v in table.data[col] if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return bool(present) and all(isinstance(v, str) and v.isdigit() for v in present)


def to_markdown(table: Table) -> str:
    """GitHub Markdown: caption, category line (when grouped), table, notes, source count."""
    cols = list(table.data.columns)
    head = [table.headers.get(c, c) for c in cols]
    lines = [f"**{table.name}**: {table.caption}", ""]
    if table.groups and any(g for g, _ in table.groups):
        lines += ["Column groups: " + "; ".join(f"{g} ({n})" for g, n in table.groups if g), ""]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---:" if _right_aligned(table, c) else "---" for c in cols) + "|")
    for row in _cells(table):
        lines.append("| " + " | ".join("–" if t is None else (f"**{t}**" if b else t) for t, b in row) + " |")
    lines.append("")
    if table.notes:
        lines += ["Notes (a missing cell is shown as –):", *[f"- {n}" for n in table.notes], ""]
    lines.append(f"Built from {len(table.sources)} job folder(s), listed in `{table.name}.sources.txt`.")
    return "\n".join(lines) + "\n"


def _tex(text: str) -> str:
    out = text
    for a, b in [("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                 ("Δ", r"$\Delta$"), ("ρ", r"$\rho$"), ("✓", r"\checkmark"), ("–", "--"), ("×", r"$\times$")]:
        out = out.replace(a, b)
    return out


def to_latex(table: Table) -> str:
    """A booktabs ``table`` environment; missing cells are ``--``; sources as comments."""
    cols = list(table.data.columns)
    spec = "".join("r" if _right_aligned(table, c) else "l" for c in cols)
    lines = [r"\begin{table}[t]", r"\centering", r"\small", rf"\caption{{{_tex(table.caption)}}}",
             rf"\label{{tab:{table.name}}}", rf"\begin{{tabular}}{{{spec}}}", r"\toprule"]
    if table.groups and any(g for g, _ in table.groups):
        lines.append(" & ".join(rf"\multicolumn{{{n}}}{{c}}{{{_tex(g)}}}" if n > 1 else _tex(g)
                                for g, n in table.groups) + r" \\")
    lines.append(" & ".join(_tex(table.headers.get(c, c)) for c in cols) + r" \\")
    lines.append(r"\midrule")
    for row in _cells(table):
        cells = ["--" if t is None else _tex(t) for t, _b in row]
        cells = ["$-$" + c[1:] if c.startswith("-") and c != "--" else c for c in cells]
        lines.append(" & ".join(rf"\textbf{{{c}}}" if b else c for c, (_t, b) in zip(cells, row)) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    lines += [f"% note: {n}" for n in table.notes] + [f"% source: {s}" for s in table.sources]
    return "\n".join(lines) + "\n"


def to_csv(table: Table, path: Path) -> None:
    """CSV with raw column names; values rounded half-up to 2 decimals; missing = empty cell."""
    data = table.data.copy()
    for col in data.columns:
        if _numeric(table, col):
            data[col] = [None if fmt(v) is None else float(fmt(v)) for v in data[col]]
    data.to_csv(path, index=False, na_rep="")


def _write_sources(out: Path, name: str, caption: str, sources: list[str], notes: list[str]) -> None:
    text = [f"# {name}: job folders this artifact was built from (relative to the results root)", f"# {caption}"]
    text += sources + ([""] + [f"# note: {n}" for n in notes] if notes else [])
    (out / f"{name}.sources.txt").write_text("\n".join(text) + "\n")


def write_table(table: Table, out: Path) -> list[Path]:
    """Write ``<name>.md``, ``.tex``, ``.csv`` and ``.sources.txt`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{table.name}.md").write_text(to_markdown(table))
    (out / f"{table.name}.tex").write_text(to_latex(table))
    to_csv(table, out / f"{table.name}.csv")
    _write_sources(out, table.name, table.caption, table.sources, table.notes)
    return [out / f"{table.name}.{ext}" for ext in ("md", "tex", "csv")]


def write_figure(fig: rf.FigureOut, out: Path) -> list[Path]:
    """Write ``<name>.png`` (150 dpi), ``<name>.pdf`` and ``<name>.sources.txt``; closes the figure."""
    base = out / fig.name
    base.parent.mkdir(parents=True, exist_ok=True)
    paths = [base.with_name(base.name + ".png"), base.with_name(base.name + ".pdf")]
    fig.fig.savefig(paths[0], dpi=150)
    fig.fig.savefig(paths[1])
    plt.close(fig.fig)
    _write_sources(base.parent, base.name, fig.caption, fig.sources, fig.notes)
    return paths


def load_latency(path: str | Path) -> list[dict]:
    """Latency records (kvbench.latency's JSON: a list of records, or ``{"records": [...]}``)."""
    data = json.loads(Path(path).read_text())
    records = data["records"] if isinstance(data, dict) else data
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError("expected a list of records (objects) or {\"records\": [...]}")
    return list(records)


def _selected(family: str, outputs: list[str], only: list[str] | None) -> bool:
    """Whether ``--only`` patterns select a family (its name, or one of its output names/patterns)."""
    if not only:
        return True
    return any(fnmatch.fnmatch(family, p) or any(fnmatch.fnmatch(o, p) or fnmatch.fnmatch(p, o) for o in outputs)
               for p in only)


def build(ctx: Context, only: list[str] | None = None) -> dict[str, list | Exception]:
    """Run the selected builders: ``{family: [Table | FigureOut, ...]}``, ``[]`` when the family
    has no inputs, or the exception it raised (one broken artifact must not stop the others)."""
    built: dict[str, list | Exception] = {}
    for family, (builder, outputs) in ARTIFACTS.items():
        if not _selected(family, outputs, only):
            continue
        try:
            arts = builder(ctx)
        except Exception as e:  # noqa: BLE001 - reported in index.md and on stderr
            built[family] = e
            continue
        whole = not only or any(fnmatch.fnmatch(family, p) for p in only)
        built[family] = [a for a in arts if whole or any(fnmatch.fnmatch(a.name, p) for p in only)]
    return built


def _store_root_above(root: Path, df: pd.DataFrame) -> Path | None:
    """The results root above ``root`` when ``root`` is one of its task, model or method folders:
    every job read under ``root`` (:func:`load_results`) sits fewer than 4 levels down, and its own
    ``<task>/<model>/<preset>/<job>`` path (task and model as its config names them) leads to one
    folder above ``root``. None for a results root (or jobs named by ``run_name``)."""
    tops = set()
    for job, task, model in df[["job", "task", "model"]].drop_duplicates().itertuples(index=False):
        folder = root / job
        if len(Path(job).parts) >= 4 or len(folder.parents) < 4:
            return None
        if (task, model) != (folder.parents[2].name, folder.parents[1].name):
            return None
        tops.add(folder.parents[3])
    return tops.pop() if len(tops) == 1 else None


def _out_inside_store(root: Path, out: Path, jobs) -> str:
    """Why ``out`` would mix report files with stored jobs (``""`` when it would not): it is the
    results root itself (the report's ``niah/`` figures would land in the task folder) or lies
    in a folder of the root that holds job folders (a task folder, a job folder)."""
    try:
        rel = out.resolve().relative_to(root.resolve())
    except ValueError:
        return ""  # outside the results root
    if not rel.parts:
        return "the results root itself"
    holders = {str(job).split("/", 1)[0] for job in jobs}
    return f"inside {str(root / rel.parts[0])!r}, which holds job folders" if rel.parts[0] in holders else ""


def note_kinds(notes: list[str]) -> str:
    """The kinds of an artifact's notes for the index and the console (``absent, incomplete``):
    each note's lead word(s), before its first colon or comma."""
    kinds = [n.split(":", 1)[0].split(",", 1)[0].strip() for n in notes]
    return ", ".join(dict.fromkeys(k for k in kinds if k)) or "see the notes"


REPORT_SUFFIXES = (".md", ".tex", ".csv", ".png", ".pdf")


def _earlier_files(out: Path, written: set[Path]) -> list[str]:
    """Table and figure files under the report folder ``out`` that this run did not write
    (relative paths, sorted; ``index.md`` aside): outputs of earlier runs whose inputs changed.
    They are kept (nothing is deleted) and listed, so they are not read as current."""
    if not out.is_dir():
        return []
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*")
                  if p.is_file() and p.suffix in REPORT_SUFFIXES and p.name != "index.md"
                  and p.resolve() not in written and not any(part.startswith(".") for part in p.relative_to(out).parts))


def _index_name(line: str) -> str | None:
    """The artifact or family an ``index.md`` line is about (``- name: ...``), else None."""
    return line[2:].split(":", 1)[0] if line.startswith("- ") and ":" in line else None


def _earlier_index_lines(path: Path, index: list[str], only: list[str]) -> list[str]:
    """The lines of an earlier ``index.md`` about artifacts a ``--only`` run did not rebuild, so
    that the index still lists every artifact of the folder (a heading marks them as earlier)."""
    try:
        old = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    new = {_index_name(line) for line in index} - {None}
    whole = [(family, outputs) for family, (_b, outputs) in ARTIFACTS.items()
             if any(fnmatch.fnmatch(family, p) for p in only)]  # families rebuilt in full

    def rebuilt(name: str) -> bool:
        return name in new or any(name == family or any(fnmatch.fnmatch(name, o) for o in outputs)
                                  for family, outputs in whole)

    kept = [line for line in old if (name := _index_name(line)) is not None and not rebuilt(name)]
    return ["", f"Earlier report runs (not rebuilt by --only {' '.join(only)}):", *kept] if kept else []


def _artifact_names() -> list[str]:
    """Every name ``--only`` accepts: the artifact families and each of their outputs."""
    return sorted({o for _b, outs in ARTIFACTS.values() for o in outs} | set(ARTIFACTS))


@quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (1 when an artifact failed to build)."""
    # RESULTS_ROOT is required (checked below); nargs="?" only lets `--only NAME ROOT` hand it back
    p = OneLineParser(prog="kvbench report", description=DESCRIPTION,
                      usage="kvbench report [-h] RESULTS_ROOT [--out OUT] [--only NAME [NAME ...]] [--latency LATENCY]")
    p.add_argument("root", metavar="RESULTS_ROOT", nargs="?", help="results root holding the job folders")
    p.add_argument("--out", help="output folder (default: RESULTS_ROOT/report)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="artifact names or patterns, space- or comma-separated: "
                   + ", ".join(_artifact_names()))
    p.add_argument("--latency", help="latency benchmark JSON for selkv_fig3 (default: RESULTS_ROOT/latency.json)")
    args = p.parse_args(argv)
    if args.root is None and args.only and len(args.only) > 1 and Path(args.only[-1]).is_dir():
        args.root = args.only.pop()  # `--only scores ROOT`: --only took the root too
    args.only = p.list_arg("--only", args.only)  # "--only scores,niah" as in the other tools; '' refused
    if args.root is None:
        p.error("the following arguments are required: RESULTS_ROOT")
    root = Path(args.root)
    if not root.is_dir():
        p.error(f"RESULTS_ROOT {str(root)!r} is not a directory")
    for pattern in args.only or []:
        if not any(_selected(family, outputs, [pattern]) for family, (_b, outputs) in ARTIFACTS.items()):
            p.error(f"--only {pattern!r}: no such artifact; accepted names: " + ", ".join(_artifact_names()))
    if (root / "config.yaml").is_file() and any((root / n).is_file() for n in ("summary.json", "predictions.jsonl")):
        p.error(f"{str(root)!r} is a job folder; pass the results root above it (output_root, e.g. "
                f"{str(root.parents[3]) if len(root.parents) > 3 else 'results'!r})")
    out = Path(args.out) if args.out else root / "report"
    blocker = next((q for q in (out, *out.parents) if q.exists() and not q.is_dir()), None)
    if blocker is not None:
        p.error(f"--out {str(out)!r}: {blocker} is a file, not a folder")
    lat_path = Path(args.latency) if args.latency else root / "latency.json"
    if args.latency and not lat_path.is_file():
        p.error(f"--latency {str(lat_path)!r}: no such file")
    try:
        latency = load_latency(lat_path) if lat_path.is_file() else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"--latency {str(lat_path)!r}: not a latency file of python -m kvbench.latency ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''})")
    df = load_results(root)
    above = _store_root_above(root, df)
    if above is not None:
        p.error(f"{str(root)!r} is a task, model or method folder inside the results root {str(above)!r}; pass "
                "that results root (reports group jobs by task, model and method from there)")
    inside = _out_inside_store(root, out, df["job"]) or store_write_refusal(out)
    if inside:
        p.error(f"--out {str(out)!r}: {inside}; write the report beside the job folders (default: RESULTS_ROOT/report) "
                "or outside the results root")
    from methods.base import ConfigError

    from .validate import check_not_in_code, check_not_in_store

    try:  # outside this root: not in another results root's task, model or method folder either
        check_not_in_code(f"--out {str(out)!r}", out, "the report (default: RESULTS_ROOT/report)")
        if not out.resolve().is_relative_to(root.resolve()):
            check_not_in_store(f"--out {str(out)!r}", out)
    except ConfigError as e:
        p.error(str(e))
    index_md = out / "index.md"
    if index_md.is_file() and not index_md.read_text(encoding="utf-8", errors="replace").startswith("# Report of "):
        p.error(f"--out {str(out)!r}: holds an index.md that is not a kvbench report's (it would be replaced); pass "
                "another folder")
    from .validate import check_creatable

    try:  # the report folder exists before the tables are built (not a traceback after them)
        check_creatable(f"--out {str(out)!r}", out)
    except ConfigError as e:
        p.error(str(e))
    ctx = Context(root, df, latency, str(lat_path))
    written: set[Path] = set()
    earlier_report = (out / "index.md").is_file()  # a report folder: its other files are earlier outputs
    n_jobs = df["job"].nunique()
    index, failed = [f"# Report of {root}", "", f"{n_jobs} job folder{'s' if n_jobs != 1 else ''} read.", ""], 0
    for line in df.attrs.get("unreadable", []):
        print(f"warning: job folder {line}; left out of the report", file=sys.stderr)
        index.insert(-1, f"Left out (unreadable): {line}")
    selected = {family for family, (_build, outputs) in ARTIFACTS.items() if _selected(family, outputs, args.only)}
    latency_only = bool(latency) and selected <= {"selkv_fig3"}  # only the figure drawn from --latency
    if n_jobs == 0 and not latency_only:
        print(f"warning: no job folders under {root} (a job folder holds config.yaml and summary.json or "
              "predictions.jsonl); " + (f"only the latency figure (selkv_fig3, from {lat_path}) can be drawn"
                                        if latency else "the report is empty"), file=sys.stderr)
    for family, arts in build(ctx, args.only).items():
        if isinstance(arts, Exception):
            failed += 1
            index.append(f"- {family}: FAILED ({type(arts).__name__}: {arts})")
            print(f"{family}: FAILED: {type(arts).__name__}: {arts}", file=sys.stderr)
            continue
        if not arts:
            index.append(f"- {family}: no inputs in this results root")
        for a in arts:
            paths = write_table(a, out) if isinstance(a, Table) else write_figure(a, out)
            written.update(q.resolve() for q in paths)
            missing = f", {len(a.notes)} note(s): {note_kinds(a.notes)}" if a.notes else ""
            index.append(f"- {a.name}: {', '.join(q.name for q in paths)} ({len(a.sources)} job{'s' if len(a.sources) != 1 else ''}{missing})")
            print(f"wrote {a.name}{missing}")
    out.mkdir(parents=True, exist_ok=True)
    if args.only:
        index += _earlier_index_lines(out / "index.md", index, args.only)
    else:
        stale = _earlier_files(out, written) if earlier_report else []
        if stale:
            index += ["", "Files of earlier report runs that this run did not write (their inputs changed, e.g. a "
                      "table renamed when jobs of another setting joined, or are gone); kept, not current:",
                      *[f"- {name}" for name in stale]]
            print(f"warning: {len(stale)} file(s) in {out} are from earlier report runs and were not rewritten "
                  f"(listed in index.md): {', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}", file=sys.stderr)
    (out / "index.md").write_text("\n".join(index) + "\n")
    print(f"report written to {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
