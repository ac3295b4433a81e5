"""``kvbench mask-heads``: head sets from score files, one-line errors before any model load,
the output files, and one end-to-end run on a tiny random model."""

from __future__ import annotations

import json

import pytest

from kvbench.tools import mask_heads
from kvbench.tools.mask_heads import conditions, main, out_stem, random_heads, render_markdown, write_report
from methods.artifacts import load_head_scores
from methods.base import ConfigError


def _score_file(path, means: list[list[float]]):
    """A HeadKV-format file whose head l-h has mean ``means[l][h]`` (two samples around it)."""
    data = {f"{l}-{h}": [m - 0.5, m + 0.5] for l, row in enumerate(means) for h, m in enumerate(row)}
    path.write_text(json.dumps(data))
    return path


SRH = [[0.1, 0.9, 0.0, 0.3], [0.8, 0.2, 0.9, 0.05]]  # top-3: (0,1), (1,2) tie at 0.9 -> layer 0 first; then (1,0)
TRH = [[0.0, 0.0, 0.7, 0.0], [0.0, 0.6, 0.0, 0.5]]  # top-3: (0,2), (1,1), (1,3)


def test_conditions_pick_top_k_across_layers_and_a_disjoint_seeded_random_control(tmp_path):
    scores = {"srh": load_head_scores(_score_file(tmp_path / "s.json", SRH)),
              "trh": load_head_scores(_score_file(tmp_path / "t.json", TRH))}
    plan = conditions(scores, [1, 2], ["srh", "trh", "random"], seed=0)
    got = {(c["kind"], c["k"]): [tuple(h) for h in c["heads"]] for c in plan}
    assert got["srh", 1] == [(0, 1)]
    assert got["srh", 2] == [(0, 1), (1, 2)]
    assert got["trh", 2] == [(0, 2), (1, 1)]
    rand = got["random", 2]
    assert len(set(rand)) == 2 and not set(rand) & (set(got["srh", 2]) | set(got["trh", 2]))
    assert plan == conditions(scores, [1, 2], ["srh", "trh", "random"], seed=0)  # reproducible
    with pytest.raises(ConfigError, match="only 2 heads are left outside the SRH/TRH top-3"):
        conditions(scores, [3], ["srh", "trh", "random"], seed=0)
    assert [tuple(h) for h in conditions(scores, [3], ["srh"], seed=0)[0]["heads"]] == [(0, 1), (1, 2), (1, 0)]
    assert [c["kind"] for c in plan] == ["srh", "trh", "random"] * 2


def test_random_heads_distinct_within_grid_and_seed_dependent():
    a = random_heads(30, 9, 30, seed=0, exclude={(0, 0)})
    assert len(set(a)) == 30 and all(0 <= l < 30 and 0 <= h < 9 for l, h in a) and (0, 0) not in a
    assert random_heads(30, 9, 10, seed=0, exclude={(0, 0)}) == a[:10]  # a larger k extends a smaller one
    assert random_heads(30, 9, 30, seed=1, exclude={(0, 0)}) != a
    with pytest.raises(ConfigError, match="only 2 heads are left"):
        random_heads(2, 2, 3, seed=0, exclude={(0, 0), (1, 1)})


def test_out_is_a_folder_or_the_files_name(tmp_path):
    """--out drop.json names the three files (drop.json/.csv/.md); a folder gets the default name."""
    assert out_stem(str(tmp_path / "drop.json"), "mask_heads_x") == tmp_path / "drop"
    assert out_stem(str(tmp_path / "sub" / "drop.md"), "mask_heads_x") == tmp_path / "sub" / "drop"
    assert out_stem(str(tmp_path / "o"), "mask_heads_x") == tmp_path / "o" / "mask_heads_x"


def test_write_report_table_and_csv(tmp_path):
    stem = tmp_path / "mask_heads_x.y"
    report = {"model": "x", "mode": "zero", "phase": "all", "no_mask": {"score": 90.0, "n": 2, "failed": 0},
              "conditions": [{"kind": "srh", "k": 1, "score": 40.0, "n": 2, "failed": 0},
                             {"kind": "trh", "k": 1, "score": None, "n": 0, "failed": 2}]}
    assert [p.name for p in write_report(stem, report)] == ["mask_heads_x.y.json", "mask_heads_x.y.csv",
                                                            "mask_heads_x.y.md"]
    assert json.loads((tmp_path / "mask_heads_x.y.json").read_text()) == report
    assert "| SRH | 50.00 (40.00) |" in render_markdown(report)  # drop = 90 - 40
    assert "| TRH | - (-) |" in render_markdown(report)
    assert (tmp_path / "mask_heads_x.y.csv").read_text().splitlines() == [
        "kind,k,score,drop,n,failed", "none,0,90.0,0.0,2,0", "srh,1,40.0,50.0,2,0", "trh,1,,,0,2"]


@pytest.fixture
def no_model_load(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("kvbench.engine.models.load_model", fail)


@pytest.mark.parametrize("args,flag", [
    (["--model", "nope"], "--model='nope'"),
    (["--model", "gemma3_270m"], "semantic_retrieval_heads.json"),
    (["--k", "10,271"], "--k=271"),
    (["--k", "10,10"], "--k"),
    (["--k", "1,x"], "--k"),
    (["--kinds", "srh,foo"], "--kinds"),
    (["--kinds", "random"], "--kinds="),
    (["--model", "llama31"], "--srh-scores"),
    (["task.context_lengths=[0]"], "task.context_lengths="),
    (["task.depth_percents=[50,150]"], "task.depth_percents="),
    (["task.max_new_tokens=0"], "task.max_new_tokens="),
    (["task.context_lengths=abc"], "task.context_lengths"),
    (["task.context_lengths="], "task.context_lengths"),
    (["device=gpu"], "device"),
    (["threads=0"], "threads"),
    (["device=cpu,cpu"], "device"),  # one value
    (["--srh-scores", "README.md", "--kinds", "srh"], "--srh-scores"),
])
def test_user_errors_are_one_line_before_loading_a_model(args, flag, tmp_path, capsys, no_model_load):
    with pytest.raises(SystemExit) as stop:
        main([*args, "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and flag in err and "\n" not in err, err
    assert not any(tmp_path.iterdir())


def test_k_larger_than_a_hand_made_grid(tmp_path, capsys, no_model_load):
    s = _score_file(tmp_path / "s.json", SRH)
    for ks in (["--k", "9", "1"], ["--k", "9,1"], ["--k", "9", "--k", "1"]):  # one list, however given
        with pytest.raises(SystemExit):
            main(["--srh-scores", str(s), "--kinds", "srh", *ks, "--out", str(tmp_path / "o")])
        assert "--k=9: must be between 1 and the 2x4 = 8 heads" in capsys.readouterr().err


def test_end_to_end_on_a_tiny_model(tiny_model_dir, haystack_dir, tmp_path, capsys):
    s, t = _score_file(tmp_path / "s.json", SRH), _score_file(tmp_path / "t.json", TRH)
    out = tmp_path / "out"
    argv = [f"model.source={tiny_model_dir}", "model.gguf_file=null", "--srh-scores", str(s), "--trh-scores", str(t),
            "--k", "1,2", "task.context_lengths=[400]", "task.depth_percents=[50]", f"task.haystack_dir={haystack_dir}",
            "task.haystack_source=dir", "task.max_new_tokens=3", "threads=1", "--out", str(out),
            "model.chat_template=none"]
    assert main(argv) == 0
    report = json.loads((out / "mask_heads_smollm2_uniform-decode.json").read_text())
    assert report["no_mask"]["n"] == 1 and report["grid"]["samples"] == 1
    heads = {(c["kind"], c["k"]): c["heads"] for c in report["conditions"]}
    assert heads["srh", 2] == [[0, 1], [1, 2]] and heads["trh", 1] == [[0, 2]]
    for c in report["conditions"]:
        assert c["n"] == 1 and 0 <= c["score"] <= 100
    table = capsys.readouterr().out
    assert "| heads | top-1 | top-2 |" in table and "| random |" in table
    assert [c["kind"] for c in report["conditions"]] == ["srh", "trh", "random"] * 2
    assert sorted(p.name for p in out.iterdir()) == [f"mask_heads_smollm2_uniform-decode.{s}" for s in ("csv", "json", "md")]


def test_cli_dispatches_mask_heads(capsys, no_model_load, tmp_path):
    from kvbench.cli import main as kvbench_main

    with pytest.raises(SystemExit):
        kvbench_main(["mask-heads", "--model", "nope", "--out", str(tmp_path)])
    assert "--model='nope'" in capsys.readouterr().err
    assert mask_heads.KINDS == ("srh", "trh", "random")


def test_published_trh_scores_of_llama31_are_found_and_checked_before_loading(tmp_path, capsys, no_model_load, monkeypatch):
    import os
    from pathlib import Path

    shared = Path(os.environ.get("KVBENCH_SHARED_DATA") or Path(mask_heads.__file__).parents[2] / "shared" / "data")
    if not (shared / "head_scores" / "compresskv" / "Llama-3.1-8B-Instruct.json").is_file():
        pytest.skip(f"published CompressKV files not found under {shared}")
    monkeypatch.setenv("KVBENCH_SHARED_DATA", str(shared))
    with pytest.raises(SystemExit):
        main(["--model", "llama31", "--kinds", "trh,random", "--k", "30,1025", "--out", str(tmp_path)])
    assert capsys.readouterr().err.strip().endswith("--k=1025: must be between 1 and the 32x32 = 1024 heads of the score file")
