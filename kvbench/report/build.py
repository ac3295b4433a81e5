"""``kvbench report RESULTS_ROOT [--out DIR] [--only NAME...] [--latency FILE]`` (docs/REPORTS.md): the
score table of every task × model and the seed papers' tables (``.md``, ``.tex``, ``.csv``) and figures
(``.png``, ``.pdf``) from the tidy frame of the store, each with ``<name>.sources.txt``, and ``index.md``."""

import json
import sys
from collections import namedtuple
from fnmatch import fnmatch
from pathlib import Path

import pandas as pd

from kvbench.report import scbench as report_scbench, tables as rt
from kvbench.cli import ArgParser
from kvbench.job.plots import plt
from kvbench.report.cost import accuracy_vs_bytes, cost_table
from kvbench.report.data import load_results
from kvbench.report.reasoning import reasoning_reports
from kvbench.report.tables import Artifact, fmt, round2
from kvbench.job.store import atomic_write

Context = namedtuple("Context", "root df latency latency_source", defaults=(None, "latency.json"))
TEX = str.maketrans({"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "_": r"\_", "#": r"\#", "Δ": r"$\Delta$",
                     "ρ": r"$\rho$", "✓": r"\checkmark", "–": "--", "×": r"$\times$", "·": r"$\cdot$", "±": r"$\pm$"})


ARTIFACTS = {  # family -> builder of its artifacts
    "scores": lambda c: rt.score_tables(c.df, c.root),
    **{task: lambda c, task=task: rt.averages_tables(c.df, c.root, task) for task in rt.AVERAGES},
    "selkv_table1": lambda c: rt.selkv_table1(c.df),
    "selkv_table2": lambda c: rt.staged_table(c.df, "selkv_table2", 0.25),
    "selkv_table3": lambda c: rt.sensitivity_table(c.df, "selkv_table3", "selkv", 0.25),
    "selkv_table4": lambda c: rt.selkv_table4(c.df),
    "selkv_ratio_tables": lambda c: rt.selkv_ratio_tables(c.df),
    "selkv_table7": lambda c: rt.selkv_table1(c.df, long=True),
    "selkv_fig2": lambda c: rt.selkv_fig2(c.df),
    "selkv_fig3": lambda c: rt.selkv_fig3(c.latency, c.latency_source),
    "selkv_fig4": lambda c: rt.budget_sweep_figure(c.df, "selkv_fig4", "longbench", True,
                                                   "LongBench average at varying KV retention ratios"),
    "selkv_fig5": lambda c: rt.budget_sweep_figure(c.df, "selkv_fig5", "longbench", True, "", per_dataset=True),
    "compresskv_table1": lambda c: rt.compresskv_table1(c.df),
    "compresskv_table2b": lambda c: rt.compresskv_table2b(c.df),
    "compresskv_table3": lambda c: rt.staged_table(c.df, "compresskv_table3a", 256) + rt.sensitivity_table(
        c.df, "compresskv_table3b", "compresskv", 256, per_dataset=False, preset="compresskv_uniform"),
    "compresskv_fig4": lambda c: rt.budget_sweep_figure(c.df, "compresskv_fig4", "longbench", False,
                                                        "LongBench average under varying KV budgets"),
    "compresskv_fig5": lambda c: rt.budget_sweep_figure(c.df, "compresskv_fig5", "niah", False,
                                                        "Needle-in-a-Haystack average under KV budgets"),
    "niah": lambda c: rt.niah_figures(c.df, c.root),
    "score_vs_budget": lambda c: rt.score_vs_budget(c.df),
    "reasoning": lambda c: reasoning_reports(c.df, c.root),
    "scbench": lambda c: report_scbench.scbench_artifacts(c.df, c.root),
    "cost": lambda c: cost_table(c.df, c.root),
    "accuracy_vs_bytes": lambda c: accuracy_vs_bytes(c.df) + accuracy_vs_bytes(c.df, read=True),
}
OUTPUTS = {"scores": ["scores_*", "paired_*"], "selkv_ratio_tables": ["selkv_table5", "selkv_table6", "selkv_ratios_*"],
           "compresskv_table3": ["compresskv_table3a", "compresskv_table3b"], "niah": ["niah_panel_*"],
           "reasoning": ["passk_*", "cache_trace_*", "gen_length_*"],  # any other family: its name, or <name>_*:
           "accuracy_vs_bytes": ["accuracy_vs_bytes", "accuracy_vs_bytes_points", "accuracy_vs_read_bytes*"],
           **{family: [f"{family}_*"] for family in [*rt.AVERAGES, "score_vs_budget", "scbench"]}}


def _cells(t: Artifact, bold: str = "**%s**", missing: str = "–", esc=str) -> pd.DataFrame:
    """Printed cells of ``t`` (``t.se`` beside the values), ``bold`` and ``missing`` as the format wants."""
    se = (pd.DataFrame() if t.se is None else t.se).reindex(index=t.data.index, columns=t.data.columns)
    cells = {c: [fmt(v, c in t.signed, e) for v, e in zip(t.data[c], se[c])] for c in t.data}  # None: missing
    return pd.DataFrame({c: [missing if v is None else (bold if (i, c) in t.bold else "%s") % esc(v)
                             for i, v in enumerate(vs)] for c, vs in cells.items()}, columns=list(t.data.columns))


def to_markdown(t: Artifact) -> str:
    """Caption, table (missing: –, best: bold, ``±``: standard error), notes, source count."""
    cells = _cells(t)
    right = [pd.api.types.is_numeric_dtype(t.data[c]) or cells[c].str.fullmatch(r"[\d–]*").all() for c in cells]
    lines = [f"**{t.name}**: {t.caption}", "", "| " + " | ".join(t.headers.get(c, c) for c in cells) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells.itertuples(index=False)]
    lines += ["", *(["Notes (a missing cell is shown as –):", *[f"- {n}" for n in t.notes], ""] if t.notes else []),
              f"Built from {len(t.sources)} job folder(s), listed in `{t.name}.sources.txt`."]
    return "\n".join(lines) + "\n"


def to_latex(t: Artifact) -> str:
    """A booktabs table (``to_latex``): missing ``--``, best ``\\textbf`` (notes, sources: ``.sources.txt``)."""
    cells = _cells(t, r"\textbf{%s}", "--", lambda v: ("$-$" + v[1:] if v.startswith("-") else v).translate(TEX))
    spec = "".join("r" if pd.api.types.is_numeric_dtype(t.data[c]) else "l" for c in t.data.columns)
    cells.columns = [t.headers.get(c, c).translate(TEX) for c in cells.columns]
    return cells.to_latex(index=False, escape=False, caption=t.caption.translate(TEX), label=f"tab:{t.name}",
                          position="t", column_format=spec)


def write(a: Artifact, out: Path) -> list[Path]:
    """Write a table (``.md``, ``.tex``, ``.csv``) or figure (``.png``, ``.pdf``) and ``<name>.sources.txt``; returns
    the table or figure paths."""
    paths = [Path(f"{out / a.name}{s}") for s in ((".png", ".pdf") if a.fig is not None else (".md", ".tex", ".csv"))]
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    if a.fig is not None:
        for path in paths:
            a.fig.savefig(path, dpi=150)
        plt.close(a.fig)
    else:
        csv = a.data.join(a.se.dropna(axis=1, how="all").add_suffix(" SE")) if a.se is not None else a.data
        csv = csv[[c for c in a.data for c in (c, f"{c} SE") if c in csv]]  # each standard error beside its value
        csv = csv.assign(**{c: csv[c].map(round2, na_action="ignore") for c in csv.select_dtypes("number").columns})
        for path, text in zip(paths, (to_markdown(a), to_latex(a), csv.to_csv(index=False, na_rep=""))):
            atomic_write(path, text)
    text = [f"# {a.name}: job folders this artifact was built from (relative to the results root)", f"# {a.caption}",
            *a.sources, *([""] + [f"# note: {n}" for n in a.notes] if a.notes else [])]
    atomic_write(Path(f"{out / a.name}.sources.txt"), "\n".join(text) + "\n")
    return paths


def _selected(family: str, only) -> bool:
    return not only or any(fnmatch(family, p) or any(fnmatch(o, p) or fnmatch(p, o)
                                                             for o in OUTPUTS.get(family, [family])) for p in only)


def build(ctx: Context, only: list[str] | None = None) -> dict[str, list | Exception]:
    """Run the selected builders: ``{family: [Artifact, ...] or the exception it raised}``."""
    built = {}
    for family, builder in ARTIFACTS.items():
        if _selected(family, only):
            try:
                built[family] = [a for a in builder(ctx) if (a.fig is not None or not a.data.empty)  # empty: no inputs
                                 and (not only or any(fnmatch(family, p) or fnmatch(a.name, p) for p in only))]
            except Exception as e:
                built[family] = e
    return built


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; exit status 1 when an artifact failed to build, on an I/O error (``--out``) or when the root
    holds no job folder (nor latency records), 2 on a usage error."""
    names = sorted({o for f in ARTIFACTS for o in OUTPUTS.get(f, [f])} | set(ARTIFACTS))
    p = ArgParser(prog="kvbench report", description="Score tables and the papers' tables and figures.")
    p.add_argument("root", metavar="RESULTS_ROOT", nargs="?")
    p.add_argument("--out", help="output folder (default: RESULTS_ROOT/report)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="artifact names or patterns: " + ", ".join(names))
    p.add_argument("--latency", help="latency JSON for selkv_fig3 (default: RESULTS_ROOT/latency.json)")
    args = p.parse_args(argv)
    only = [x for item in args.only or [] for x in item.split(",") if x]
    if args.root is None and len(only) > 1 and Path(only[-1]).is_dir():  # `--only NAME ROOT`
        args.root = only.pop()
    if args.root is None or not Path(args.root).is_dir():
        p.error(f"RESULTS_ROOT {'is required' if args.root is None else repr(args.root) + ' is not a directory'}")
    root, out = Path(args.root), Path(args.out or Path(args.root) / "report")
    if bad := [x for x in only if not any(_selected(f, [x]) for f in ARTIFACTS)]:
        p.error(f"--only {bad[0]!r}: no such artifact; accepted: {', '.join(names)}")
    lat_path = Path(args.latency or root / "latency.json")
    try:
        latency = json.loads(lat_path.read_text()) if args.latency or lat_path.is_file() else None
        if not (latency is None or isinstance(latency, list) and all(isinstance(r, dict) for r in latency)):
            raise ValueError("expected a list of records")
    except (OSError, ValueError) as e:
        p.error(f"--latency {str(lat_path)!r}: not a latency file of python -m kvbench.tools.latency ({type(e).__name__}: {e})")
    df = load_results(root)
    for line in df.attrs["unreadable"]:
        print(f"warning: job folder {line}; left out of the report", file=sys.stderr)
    if df.empty and not latency:
        p.error(f"no job folders under {root} (a job folder holds config.yaml and identity.json, summary.json or "
                "predictions.jsonl)", 1)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {str(out)!r}: {'Not a directory' if isinstance(e, FileExistsError) else e.strerror}", 1)
    index = [f"# Report of {root}", "", f"{df['job'].nunique()} job folder(s) read.",
             *[f"Left out (unreadable): {line}" for line in df.attrs["unreadable"]],  # and jobs with no stored sample:
             *[f"Started, no samples: {job}" for job in sorted(df.loc[df["dataset"].isna(), "job"])], ""]
    if df.empty and not (only and all(fnmatch("selkv_fig3", x) for x in only)):
        print(f"warning: no job folders under {root}; only the latency figure is drawn", file=sys.stderr)
    built = build(Context(root, df[df["dataset"].notna()], latency, str(lat_path)), only)  # jobs with samples
    for family, arts in built.items():
        if isinstance(arts, Exception):
            index.append(f"- {family}: FAILED ({type(arts).__name__}: {arts})")
            print(f"{family}: FAILED: {type(arts).__name__}: {arts}", file=sys.stderr)
        index += [f"- {family}: no inputs in this results root"] if arts == [] else []
        for a in arts if isinstance(arts, list) else []:
            kinds = ", ".join(dict.fromkeys(n.split(":")[0] for n in a.notes))
            kinds = f", {len(a.notes)} note(s): {kinds}" if a.notes else ""
            index.append(f"- {a.name}: {', '.join(q.name for q in write(a, out))} ({len(a.sources)} job(s){kinds})")
            print(f"wrote {a.name}{kinds}")
    atomic_write(out / "index.md", "\n".join(index) + "\n")
    print(f"report written to {out}")
    return int(any(isinstance(a, Exception) for a in built.values()))


if __name__ == "__main__":
    sys.exit(main())
