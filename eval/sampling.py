"""Scores of sampled candidates: a problem's candidates (records sharing ``problem``, ENGINE_CONTRACT: ``sampling.n``)
are one sample. pass@1 is the mean over problems of the share of correct candidates, its standard error the
spread of those shares over problems; pass@k is Chen et al. (2021)'s unbiased estimator, eq. (1)."""

from __future__ import annotations

import math
import statistics
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of ``k`` candidates drawn without replacement from ``n``, ``c`` of them correct, is
    correct: ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021, eq. 1; exact integers). ValueError: not
    ``0 <= c <= n`` and ``1 <= k <= n``."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def by_problem(records: list[dict]) -> dict[str, dict[str, list[dict]]]:
    """The successful, scored records grouped by ``dataset``, then by problem (``problem``, else the record's ``id``:
    an unsampled record is its own problem), in stored order."""
    out: dict[str, dict[str, list[dict]]] = {}
    for i, r in enumerate(records):
        if r.get("error") is None and r.get("score") is not None:
            key = r.get("id", i) if r.get("problem") is None else str(r["problem"])
            out.setdefault(r["dataset"], {}).setdefault(key, []).append(r)
    return out


def summary(records: list[dict]) -> dict[str, dict[str, Any]]:
    """Per dataset, in % (two decimals): ``pass@1`` (mean over problems of the mean candidate score) and ``pass@1_se``
    (SD of those means / √problems; null under two problems), ``pass@k`` for k = 1, 2, 4, ... up to the fewest
    candidates of a problem (a candidate is correct when it scores 1; empty unless every candidate scores 0 or 1, as
    pass@k counts right answers), ``answered`` (share of candidates whose
    ``scores.found`` is true; null when no record says), the mean ``generated_tokens`` of a candidate, and the counts
    ``problems`` and ``candidates``."""
    out = {}
    for dataset, problems in by_problem(records).items():
        means = [sum(float(r["score"]) for r in rs) / len(rs) for rs in problems.values()]
        n_min = min(len(rs) for rs in problems.values())
        flat = [r for rs in problems.values() for r in rs]
        binary = all(float(r["score"]) in (0, 1) for r in flat)  # pass@k counts right answers
        ks = [2**i for i in range(n_min.bit_length()) if 2**i <= n_min] if binary else []
        found = [bool(r["scores"]["found"]) for r in flat if "found" in (r.get("scores") or {})]
        tokens = [r["generated_tokens"] for r in flat if isinstance(r.get("generated_tokens"), (int, float))]
        pct = lambda v: None if v is None else round(100 * v, 2)
        out[dataset] = {
            "pass@1": pct(sum(means) / len(means)),
            "pass@1_se": pct(statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else None),
            "pass@k": {str(k): pct(sum(pass_at_k(len(rs), sum(float(r["score"]) >= 1 for r in rs), k)
                                       for rs in problems.values()) / len(problems)) for k in ks},
            "answered": pct(sum(found) / len(found) if found else None),
            "generated_tokens": round(sum(tokens) / len(tokens), 2) if tokens else None,
            "problems": len(problems), "candidates": len(flat),
        }
    return out
