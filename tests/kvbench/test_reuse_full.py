"""Full-cache jobs of a method × budget sweep compute their samples once (``reuse_full``).

The full cache keeps every token, so ``method=full`` at budget 0.25 computes what it computes
at 0.5: the second job copies the first one's records (``reused_from``) instead of running
the model on them, and only when every setting but the budget is the same.
"""

from __future__ import annotations

import json

from tests.kvbench.cli_util import read_lines, run_cli, tiny_model_args

GRID = ["task.context_lengths=[300]", "task.depth_percents=[0,100]", "task.max_new_tokens=4", "quiet=true"]


def _args(model_dir, haystack_dir, root, *extra: str) -> list[str]:
    return [*tiny_model_args(model_dir), *GRID, f"task.haystack_dir={haystack_dir}", f"output_root={root}",
            "method=full", *extra]


def test_a_sweep_over_budgets_computes_the_full_cache_once(tiny_model_dir, haystack_dir, tmp_path):
    out = run_cli(["-m", *_args(tiny_model_dir, haystack_dir, tmp_path, "budget=0.5,0.25,0.75")])
    assert out.returncode == 0, out.stderr[-2000:]
    first = read_lines(tmp_path / "niah/tiny/full/b0.5/predictions.jsonl")
    second = read_lines(tmp_path / "niah/tiny/full/b0.25/predictions.jsonl")
    assert [r["id"] for r in first] == ["niah/300/0", "niah/300/100"]
    assert all("reused_from" not in r for r in first)
    assert [r.pop("reused_from") for r in second] == ["niah/tiny/full/b0.5"] * 2
    assert second == first  # the same records, timings included: nothing was recomputed
    assert "2 samples copied from the full-cache job niah/tiny/full/b0.5 (" in out.stdout + out.stderr
    # b0.75 reads b0.25 first (folders in name order): the records and the log name the job that computed them
    third = read_lines(tmp_path / "niah/tiny/full/b0.75/predictions.jsonl")
    assert [r["reused_from"] for r in third] == ["niah/tiny/full/b0.5"] * 2
    assert ("2 samples copied from the full-cache job niah/tiny/full/b0.25, computed by niah/tiny/full/b0.5 (2) ("
            in out.stdout + out.stderr)
    summary = json.loads((tmp_path / "niah/tiny/full/b0.25/summary.json").read_text())
    assert summary["complete"] and summary["n_samples"] == 2 and summary["n_reused"] == 2
    assert summary["budget"] == 0.25


def test_only_missing_samples_are_copied_and_the_rest_run(tiny_model_dir, haystack_dir, tmp_path):
    """The sibling holds one of the two samples (max_samples=1): one copied, one computed here."""
    one = run_cli(_args(tiny_model_dir, haystack_dir, tmp_path, "budget=0.5", "max_samples=1"))
    assert one.returncode == 0, one.stderr[-2000:]
    both = run_cli(_args(tiny_model_dir, haystack_dir, tmp_path, "budget=0.25"))
    assert both.returncode == 0, both.stderr[-2000:]
    records = {r["id"]: r for r in read_lines(tmp_path / "niah/tiny/full/b0.25/predictions.jsonl")}
    assert records["niah/300/0"]["reused_from"] == "niah/tiny/full/b0.5"
    assert "reused_from" not in records["niah/300/100"]
    # the summaries say which run scored part of the grid (max_samples cut it) and which the whole
    subsets = [json.loads((tmp_path / f"niah/tiny/full/{b}/summary.json").read_text())["subset"] for b in ("b0.5", "b0.25")]
    assert subsets == ["max_samples=1", ""]


def test_no_reuse_across_settings_or_when_turned_off(tiny_model_dir, haystack_dir, tmp_path):
    base = run_cli(_args(tiny_model_dir, haystack_dir, tmp_path, "budget=0.5", "task.max_new_tokens=3"))
    assert base.returncode == 0, base.stderr[-2000:]
    # another generation length is another computation: nothing copied
    other = run_cli(_args(tiny_model_dir, haystack_dir, tmp_path, "budget=0.25"))
    assert other.returncode == 0, other.stderr[-2000:]
    assert all("reused_from" not in r for r in read_lines(tmp_path / "niah/tiny/full/b0.25/predictions.jsonl"))
    # the same setting with reuse_full=false: computed again (and reuse_full is not a new setting)
    off = run_cli(_args(tiny_model_dir, haystack_dir, tmp_path, "budget=0.75", "task.max_new_tokens=3",
                        "reuse_full=false"))
    assert off.returncode == 0, off.stderr[-2000:]
    assert all("reused_from" not in r for r in read_lines(tmp_path / "niah/tiny/full/b0.75/predictions.jsonl"))
    again = run_cli(_args(tiny_model_dir, haystack_dir, tmp_path, "budget=0.75", "task.max_new_tokens=3"))
    assert again.returncode == 0 and "already complete" in again.stdout + again.stderr, again.stderr[-2000:]


def test_a_compressed_method_never_copies(tiny_model_dir, haystack_dir, tmp_path):
    full = run_cli(_args(tiny_model_dir, haystack_dir, tmp_path, "budget=1.0"))
    assert full.returncode == 0, full.stderr[-2000:]
    args = [a for a in _args(tiny_model_dir, haystack_dir, tmp_path, "budget=1.0") if a != "method=full"]
    snap = run_cli([*args, "method=snapkv"])
    assert snap.returncode == 0, snap.stderr[-2000:]
    assert all("reused_from" not in r for r in read_lines(tmp_path / "niah/tiny/snapkv/b1.0/predictions.jsonl"))


def test_reuse_full_must_be_a_boolean(tiny_model_dir, tmp_path):
    out = run_cli([*tiny_model_args(tiny_model_dir), f"output_root={tmp_path}", "reuse_full=maybe"])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "error: reuse_full=maybe: must be true or false"


def test_no_reuse_from_a_job_whose_auto_settings_resolved_otherwise(tiny_model_dir, haystack_dir, tmp_path):
    """device=auto is stored as 'auto': a sibling run on a GPU (env.json: cuda, bfloat16) is not copied."""
    base = run_cli(_args(tiny_model_dir, haystack_dir, tmp_path, "budget=0.5"))
    assert base.returncode == 0, base.stderr[-2000:]
    env_path = tmp_path / "niah/tiny/full/b0.5/env.json"
    env = json.loads(env_path.read_text())
    env_path.write_text(json.dumps({**env, "device": "cuda:0", "dtype": "bfloat16"}))
    other = run_cli(_args(tiny_model_dir, haystack_dir, tmp_path, "budget=0.25"))
    assert other.returncode == 0, other.stderr[-2000:]
    assert all("reused_from" not in r for r in read_lines(tmp_path / "niah/tiny/full/b0.25/predictions.jsonl"))


def test_concurrent_full_jobs_compute_each_sample_once(tiny_model_dir, haystack_dir, tmp_path):
    """Three full-cache jobs of one setting at once (hydra/launcher=parallel, as SLURM array tasks
    run): each sample is computed by one of them and copied by the others (kvbench/full_share.py),
    whether they overlapped or one started after another finished. Samples are slowed down
    (KVBENCH_SAMPLE_DELAY_S) so that the jobs do run together."""
    grid = ["task.context_lengths=[300,400]", "task.depth_percents=[0,50,100]"]
    args = ["-m", *_args(tiny_model_dir, haystack_dir, tmp_path, "budget=0.25,0.5,0.75"), *grid,
            "hydra/launcher=parallel", "hydra.launcher.n_jobs=3", "threads=1"]
    out = run_cli(args, KVBENCH_SAMPLE_DELAY_S="0.7")
    assert out.returncode == 0, out.stderr[-3000:]
    computed: dict[str, list[str]] = {}
    for budget in ("b0.25", "b0.5", "b0.75"):
        records = read_lines(tmp_path / "niah/tiny/full" / budget / "predictions.jsonl")
        assert sorted(r["id"] for r in records) == sorted(f"niah/{n}/{d}" for n in (300, 400) for d in (0, 50, 100))
        assert all(r["error"] is None for r in records)
        for r in records:
            computed.setdefault(r["id"], []).append(r.get("reused_from") or f"niah/tiny/full/{budget}")
        assert json.loads((tmp_path / "niah/tiny/full" / budget / "summary.json").read_text())["complete"]
    assert all(len(set(jobs)) == 1 for jobs in computed.values()), computed  # one computing job per sample


def test_a_claimed_sample_is_copied_once_its_holder_stored_it(tmp_path):
    """Two jobs' claims on one sample (flock on one stripe file; two descriptors conflict even in
    one process): the second cannot take it while the first holds it, and once the first has
    stored the record and released the claim, the second copies it instead of computing it."""
    from kvbench.full_share import FullCacheShare

    preset = tmp_path / "niah/tiny/full"
    a, b = preset / "b0.25", preset / "b0.5"
    a.mkdir(parents=True), b.mkdir(parents=True)
    sha = "ab" * 32
    share_a = FullCacheShare(a, tmp_path, {"s1": sha}, lambda folder: True)
    share_b = FullCacheShare(b, tmp_path, {"s1": sha}, lambda folder: folder == a)
    held = share_a.claim("s1", wait=False)
    assert held is not None and share_b.claim("s1", wait=False) is None
    assert share_b.copy_of("s1") is None
    (a / "predictions.jsonl").write_text(json.dumps({"id": "s1", "error": None, "prompt_sha256": sha, "score": 1.0})
                                         + "\n" + '{"id": "s2", "err')  # and half a line being written
    share_a.release(held)
    mine = share_b.claim("s1", wait=True)
    assert share_b.copy_of("s1") == {"id": "s1", "error": None, "prompt_sha256": sha, "score": 1.0,
                                     "reused_from": "niah/tiny/full/b0.25"}
    share_b.release(mine)
    # a record of another prompt (the sample id reused for other text) or with an error is never copied
    c = preset / "b0.75"
    c.mkdir()
    (c / "predictions.jsonl").write_text(json.dumps({"id": "s1", "error": None, "prompt_sha256": "cd" * 32}) + "\n")
    share_c = FullCacheShare(c, tmp_path, {"s1": "ef" * 32}, lambda folder: True)
    assert share_c.copy_of("s1") is None
    assert sorted(p.name for p in preset.iterdir()) == [".full_claims", "b0.25", "b0.5", "b0.75"]
