"""``kvbench mask-heads``: head sets from score files, one-line errors before any model load,
never-overwritten outputs, and one end-to-end run on a tiny random model."""

from __future__ import annotations

import json

import pytest

from kvbench import mask_heads
from kvbench.mask_heads import conditions, main, out_stem, output_stem, random_heads, render_markdown, write_report
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
    """--out drop.json names the three files (drop.json/.csv/.md), no folder called drop.json;
    a folder gets the default name; an existing file in the way is one ConfigError."""
    assert out_stem(str(tmp_path / "drop.json"), "mask_heads_x") == tmp_path / "drop"
    assert out_stem(str(tmp_path / "sub" / "drop.md"), "mask_heads_x") == tmp_path / "sub" / "drop"
    assert out_stem(str(tmp_path / "o"), "mask_heads_x") == tmp_path / "o" / "mask_heads_x"
    (tmp_path / "drop.json").write_text("{}")  # never overwritten: the next free stem
    assert out_stem(str(tmp_path / "drop.csv"), "mask_heads_x") == tmp_path / "drop-2"
    (tmp_path / "notes.txt").write_text("x")
    for out in ("notes.txt", "notes.txt/o", "notes.txt/drop.json"):
        with pytest.raises(ConfigError, match=r"^--out=.*notes.txt is a file"):
            out_stem(str(tmp_path / out), "mask_heads_x")
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []  # nothing created before the run writes


def test_output_stem_and_write_never_overwrite(tmp_path):
    stem = output_stem(tmp_path, "mask_heads_x")
    assert stem == tmp_path / "mask_heads_x"
    report = {"model": "x", "mode": "zero", "phase": "all", "no_mask": {"score": 90.0, "n": 2, "failed": 0},
              "conditions": [{"kind": "srh", "k": 1, "score": 40.0, "n": 2, "failed": 0}]}
    write_report(stem, report)
    assert output_stem(tmp_path, "mask_heads_x") == tmp_path / "mask_heads_x-2"
    before = stem.with_suffix(".json").read_text()
    with pytest.raises(ConfigError, match="already exists; not overwritten"):
        write_report(stem, {**report, "model": "y"})
    assert stem.with_suffix(".json").read_text() == before
    assert "| SRH | 50.00 (40.00) |" in render_markdown(report)  # drop = 90 - 40
    assert stem.with_suffix(".csv").read_text().splitlines()[1:] == ["none,0,90.0,0.0,2,0", "srh,1,40.0,50.0,2,0"]


@pytest.fixture
def no_model_load(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("kvbench.models.load_model", fail)


@pytest.mark.parametrize("args,text", [
    (["--model", "nope"], "--model='nope': no conf/model/nope.yaml; accepted values are"),
    (["--model", "gemma3_270m"], "semantic_retrieval_heads.json': file not found; make it with `python -m methods.calibrate heads --name gemma3_270m`"),
    (["--k", "10,271"], "--k=271: must be between 1 and the 30x9 = 270 heads of the score file"),
    (["--k", "10,10"], "--k='10,10': must be distinct positive integers"),
    (["--kinds", "srh,foo"], "--kinds='srh,foo': comma-separated values among srh, trh, random"),
    (["--model", "llama31"], "--srh-scores: model llama31 has only the published per-layer SRH ranking"),
    (["--lengths", "0"], "--lengths='0': must be a non-empty list of positive integers"),
    (["--depths", "50,150"], "--depths='50,150': must be a non-empty list of numbers in [0, 100]"),
    (["--max-new-tokens", "0"], "--max-new-tokens=0: must be an integer >= 1"),
    (["--lengths", "100000"], "--lengths=100000: every length exceeds the prompt budget of 7500 tokens of model smollm2"),
    (["--lengths", "abc"], "--lengths='abc': comma-separated integers"),
    (["--device", "gpu"], "--device gpu: accepted values are auto, cpu, cuda, cuda:<index>, mps"),
    (["--threads", "0"], "--threads 0: must be an integer >= 1"),
    (["--srh-scores", "README.md", "--kinds", "srh"], "--srh-scores='README.md': not valid JSON"),
    (["--lengths", ""], "--lengths='': empty; name at least one value"),
])
def test_user_errors_are_one_line_before_loading_a_model(args, text, tmp_path, capsys, no_model_load):
    assert main([*args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert text in err and "\n" not in err, err
    assert not any(tmp_path.iterdir())


def test_k_larger_than_a_hand_made_grid(tmp_path, capsys, no_model_load):
    s = _score_file(tmp_path / "s.json", SRH)
    assert main(["--srh-scores", str(s), "--kinds", "srh", "--k", "9", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == "kvbench mask-heads: --k=9: must be between 1 and the 2x4 = 8 heads of the score file"


def test_end_to_end_on_a_tiny_model(tiny_model_dir, haystack_dir, tmp_path, capsys):
    s, t = _score_file(tmp_path / "s.json", SRH), _score_file(tmp_path / "t.json", TRH)
    out = tmp_path / "out"
    argv = ["--model-source", str(tiny_model_dir), "--srh-scores", str(s), "--trh-scores", str(t), "--k", "1,2",
            "--lengths", "400", "--depths", "50", "--haystack-dir", str(haystack_dir), "--max-new-tokens", "3",
            "--threads", "1", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "mask_heads_smollm2_uniform-decode.json").read_text())
    assert report["no_mask"]["n"] == 1 and report["grid"]["samples"] == 1
    heads = {(c["kind"], c["k"]): c["heads"] for c in report["conditions"]}
    assert heads["srh", 2] == [[0, 1], [1, 2]] and heads["trh", 1] == [[0, 2]]
    for c in report["conditions"]:
        assert c["n"] == 1 and 0 <= c["score"] <= 100
    table = capsys.readouterr().out
    assert "| heads | top-1 | top-2 |" in table and "| random |" in table
    assert main(argv) == 0  # a second run writes new files
    assert (out / "mask_heads_smollm2_uniform-decode-2.json").is_file()
    assert json.loads((out / "mask_heads_smollm2_uniform-decode.json").read_text())["seconds"] == report["seconds"]


def test_an_interrupted_run_keeps_its_finished_conditions_and_the_same_command_resumes(
        tiny_model_dir, haystack_dir, tmp_path, capsys, monkeypatch):
    s = _score_file(tmp_path / "s.json", SRH)
    out = tmp_path / "out"
    argv = ["--model-source", str(tiny_model_dir), "--srh-scores", str(s), "--kinds", "srh,random", "--k", "1,2",
            "--lengths", "400", "--depths", "50", "--haystack-dir", str(haystack_dir), "--max-new-tokens", "2",
            "--threads", "1", "--out", str(out)]
    real, calls = mask_heads.run_condition, []

    def stop_at_the_third(*args, **kwargs):  # no mask, srh top-1, then Ctrl-C
        calls.append(args[4])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(mask_heads, "run_condition", stop_at_the_third)
    assert main(argv) == 130
    assert "conditions that finished are kept in <out>/<name>.partial.json" in capsys.readouterr().err
    partial = out / "mask_heads_smollm2_uniform-decode.partial.json"
    kept = json.loads(partial.read_text())
    assert kept["no_mask"]["n"] == 1 and [(c["kind"], c["k"]) for c in kept["conditions"]] == [("srh", 1)]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [partial.name]  # no final files yet

    # other settings (another seed) never touch that progress file: they write to the next stem
    calls.clear()
    monkeypatch.setattr(mask_heads, "run_condition", real)
    assert main([*(a if a != "1,2" else "1" for a in argv), "--seed", "1"]) == 0
    assert (out / "mask_heads_smollm2_uniform-decode-2.json").is_file()
    assert json.loads(partial.read_text()) == kept

    monkeypatch.setattr(mask_heads, "run_condition", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    assert main(argv) == 0
    assert "resuming from" in capsys.readouterr().err and len(calls) == 3  # random top-1, srh top-2, random top-2
    report = json.loads((out / "mask_heads_smollm2_uniform-decode.json").read_text())
    assert [(c["kind"], c["k"]) for c in report["conditions"]] == [("srh", 1), ("random", 1), ("srh", 2),
                                                                     ("random", 2)]
    assert report["conditions"][0] == kept["conditions"][0] and report["no_mask"] == kept["no_mask"]
    assert "settings" not in report and not partial.exists()
    assert report["seconds"] >= kept["seconds"]


def test_a_second_run_on_the_same_stem_stops_at_once(tmp_path):
    first = mask_heads._lock_stem(tmp_path / "mask_heads_x", "o")
    with pytest.raises(ConfigError, match="is being written by another kvbench mask-heads run of the same settings"):
        mask_heads._lock_stem(tmp_path / "mask_heads_x", "o")
    first.close()  # the first run ended: the stem is free again
    mask_heads._lock_stem(tmp_path / "mask_heads_x", "o").close()


def test_list_flags_take_commas_spaces_or_repeats(tmp_path, capsys, no_model_load):
    """--k 10 20, --k 10,20 and --k 10 --k 20 are one list, as in kvbench.latency and benchmarks."""
    s = _score_file(tmp_path / "s.json", SRH)
    for ks in (["--k", "9", "1"], ["--k", "9,1"], ["--k", "9", "--k", "1"]):
        assert main(["--srh-scores", str(s), "--kinds", "srh", *ks, "--out", str(tmp_path / "o")]) == 2
        assert capsys.readouterr().err.strip() == ("kvbench mask-heads: --k=9: must be between 1 and the 2x4 = 8 heads "
                                                   "of the score file")


def test_cli_dispatches_mask_heads(capsys, no_model_load, tmp_path):
    from kvbench.cli import main as kvbench_main

    assert kvbench_main(["mask-heads", "--model", "nope", "--out", str(tmp_path)]) == 2
    assert "no conf/model/nope.yaml" in capsys.readouterr().err
    assert mask_heads.KINDS == ("srh", "trh", "random")


def test_published_trh_scores_of_llama31_are_found_and_checked_before_loading(tmp_path, capsys, no_model_load, monkeypatch):
    import os
    from pathlib import Path

    shared = Path(os.environ.get("KVBENCH_SHARED_DATA") or Path(mask_heads.ROOT) / ".." / "shared" / "data")
    if not (shared / "head_scores" / "compresskv" / "Llama-3.1-8B-Instruct.json").is_file():
        pytest.skip(f"published CompressKV files not found under {shared}")
    monkeypatch.setenv("KVBENCH_SHARED_DATA", str(shared))
    assert main(["--model", "llama31", "--kinds", "trh,random", "--k", "30,1025", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith("--k=1025: must be between 1 and the 32x32 = 1024 heads of the score file")


def test_out_in_the_checkout_or_its_docs_is_refused(capsys, no_model_load):
    """--out . / docs/ / README.md would scatter the ablation's files among the code."""
    from kvbench import validate

    for out, text in ((str(validate.CHECKOUT), "the kvbench checkout itself"),
                      (str(validate.CHECKOUT / "docs"), "inside kvbench's own docs/ folder"),
                      (str(validate.CHECKOUT / "README.md"), "the kvbench checkout itself")):
        assert main(["--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert text in err and "\n" not in err, err
