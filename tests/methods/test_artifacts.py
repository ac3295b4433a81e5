"""Artifact loaders on the published HeadKV / CompressKV files and on small hand-made files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from methods.artifacts import (
    artifact_path,
    load_head_ranking,
    load_head_scores,
    load_layer_scores,
    ranking_from_scores,
    top_heads,
)
from methods.base import ConfigError, HeadLayout

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("KVBENCH_SHARED_DATA") or ROOT / ".." / "shared" / "data")
CKV = SHARED / "head_scores" / "compresskv"
HKV = SHARED / "head_scores" / "headkv"
needs_shared = pytest.mark.skipif(not CKV.is_dir(), reason=f"published head scores not found at {CKV}")

LAYOUT_32 = HeadLayout(32, 32, 8, 128, tuple(range(32)), "llama31")


@needs_shared
@pytest.mark.parametrize("model,first", [("Llama-3.1-8B-Instruct", [11, 25, 23, 27]), ("Mistral-7B-Instruct-v0.3", [26, 28, 17, 16])])
def test_published_head_idx(model, first):
    ranking = load_head_ranking(CKV / f"{model}_head_idx.json", LAYOUT_32)
    assert len(ranking) == 32
    for ids in ranking:
        assert sorted(ids) == list(range(32))  # a full permutation of the query heads
    assert ranking[0][:4] == first  # file order = rank order, best first


@needs_shared
@pytest.mark.parametrize("model", ["Llama-3.1-8B-Instruct", "Mistral-7B-Instruct-v0.3"])
def test_published_layer_scores(model):
    path = CKV / f"{model}_layer_score.jsonl"
    scores = load_layer_scores(path, LAYOUT_32)
    raw = json.loads(path.read_text())
    assert scores.shape == (32,)
    assert math.isclose(float(scores.sum()), 1.0, rel_tol=1e-9)
    assert scores.tolist() == raw["avg_score"]
    per_dataset = load_layer_scores(path, LAYOUT_32, key="qasper")
    assert per_dataset.tolist() == raw["qasper"]


@needs_shared
def test_published_raw_scores_and_headkv_files():
    raw = load_head_scores(CKV / "Llama-3.1-8B-Instruct.json", LAYOUT_32)
    assert raw.shape == (32, 32)
    lst = json.loads((CKV / "Llama-3.1-8B-Instruct.json").read_text())["16-1"]
    assert raw[16, 1].item() == pytest.approx(sum(lst) / len(lst))
    for f in sorted(HKV.glob("*.json")):
        s = load_head_scores(f, LAYOUT_32)
        assert s.shape == (32, 32) and (s >= 0).all() and s.sum() > 0


@needs_shared
def test_published_files_reject_wrong_layout():
    small = HeadLayout(30, 9, 3, 64, tuple(range(30)), "smollm2")
    with pytest.raises(ConfigError, match="32 layers"):
        load_head_ranking(CKV / "Llama-3.1-8B-Instruct_head_idx.json", HeadLayout(30, 32, 8, 128, (), "x"))
    with pytest.raises(ConfigError, match="head_idx.json"):
        load_head_ranking(CKV / "Llama-3.1-8B-Instruct_head_idx.json", small)
    with pytest.raises(ConfigError, match="32 layers x 32"):
        load_head_scores(CKV / "Llama-3.1-8B-Instruct.json", small)


def test_layer_scores_jsonl_lines_compute_avg(tmp_path):
    p = tmp_path / "layer_score.jsonl"
    p.write_text('{"a": [1.0, 3.0]}\n{"b": [3.0, 1.0]}\n')
    # mean over datasets = [2, 2] -> L1-normalised [0.5, 0.5]
    assert load_layer_scores(p).tolist() == pytest.approx([0.5, 0.5])
    p.write_text('{"a": [1.0, 0.0]}\n{"b": [0.5, 0.5]}\n')
    assert load_layer_scores(p).tolist() == pytest.approx([0.75, 0.25])
    with pytest.raises(ConfigError, match="layer_score_key"):
        load_layer_scores(p, key="nope")


def test_head_scores_hand_made(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"0-0": [1, 3], "0-1": [0], "1-0": [1], "1-1": [5, 5, 5]}))
    assert load_head_scores(p).tolist() == [[2.0, 0.0], [1.0, 5.0]]
    p.write_text(json.dumps({"0-0": [1], "0-1": [1], "1-0": [1]}))
    with pytest.raises(ConfigError, match="s.json"):
        load_head_scores(p)
    p.write_text(json.dumps({"0_0": [1]}))
    with pytest.raises(ConfigError, match="s.json"):
        load_head_scores(p)
    p.write_text(json.dumps({"0-0": []}))
    with pytest.raises(ConfigError, match="s.json"):
        load_head_scores(p)


def test_ranking_rejects_repeats_and_gaps(tmp_path):
    p = tmp_path / "idx.json"
    p.write_text(json.dumps({"0": [1, 1]}))
    with pytest.raises(ConfigError, match="idx.json"):
        load_head_ranking(p)
    p.write_text(json.dumps({"0": [1], "2": [0]}))
    with pytest.raises(ConfigError, match="idx.json"):
        load_head_ranking(p)


def test_ranking_from_scores_stable_descending():
    scores = torch.tensor([[0.1, 0.5, 0.5, 0.0], [3.0, 2.0, 1.0, 4.0]])
    assert ranking_from_scores(scores) == [[1, 2, 0, 3], [3, 0, 1, 2]]


def test_missing_artifact_names_the_command(tmp_path):
    with pytest.raises(ConfigError) as e:
        artifact_path("srh_head_idx", "no_such_model", None, "method.head_idx_path")
    msg = str(e.value)
    assert "\n" not in msg and "method.head_idx_path" in msg
    assert "kvbench calibrate heads --name no_such_model" in msg
    with pytest.raises(ConfigError, match="calibrate layers"):
        artifact_path("layer_score", "m", str(tmp_path / "x.jsonl"), "method.layer_score_path")
    f = tmp_path / "given.json"
    f.write_text("{}")
    assert artifact_path("srh_head_idx", "", str(f), "k") == f


def test_ranking_from_a_score_file(tmp_path):
    p = tmp_path / "raw.json"
    p.write_text(json.dumps({"0-0": [1, 3], "0-1": [0], "0-2": [4], "1-0": [1], "1-1": [5], "1-2": [0, 2]}))
    assert load_head_ranking(p) == [[2, 0, 1], [1, 0, 2]]


def test_top_heads_across_layers_from_a_hand_made_file(tmp_path):
    p = tmp_path / "raw.json"
    # means: layer 0 = [2, 0, 4], layer 1 = [1, 5, 1]; ties (1.0) keep layer-major file order
    p.write_text(json.dumps({"0-0": [1, 3], "0-1": [0], "0-2": [4], "1-0": [1], "1-1": [5], "1-2": [0, 2]}))
    scores = load_head_scores(p)
    assert top_heads(scores, 2) == [(1, 1), (0, 2)]
    assert top_heads(scores, 5) == [(1, 1), (0, 2), (0, 0), (1, 0), (1, 2)]
    assert top_heads(scores, 0) == []
    with pytest.raises(ConfigError, match="^--k=7: must be between 0 and the 2x3 = 6 heads"):
        top_heads(scores, 7, "--k")


@needs_shared
def test_top_heads_of_the_published_trh_scores_follow_each_layers_ranking():
    scores = load_head_scores(CKV / "Mistral-7B-Instruct-v0.3.json", LAYOUT_32)
    heads = top_heads(scores, 30)
    assert len(set(heads)) == 30
    ranking = ranking_from_scores(scores)
    for layer in {l for l, _ in heads}:  # a layer's chosen heads are the top of its own ranking
        chosen = [h for l, h in heads if l == layer]
        assert sorted(chosen) == sorted(ranking[layer][: len(chosen)])
    values = [float(scores[l, h]) for l, h in heads]
    assert values == sorted(values, reverse=True) and values[-1] >= float(scores.flatten().sort(descending=True).values[29])
