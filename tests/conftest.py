"""Shared fixtures: tiny randomly initialised models of each supported family, built from configs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# ../shared/data next to the repository (a worktree under wt/ finds it one level further up)
SHARED_DATA = next((p for p in (ROOT.parent / "shared" / "data", ROOT.parent.parent / "shared" / "data") if p.is_dir()),
                   ROOT.parent / "shared" / "data")
sys.path.insert(0, str(ROOT))
# Torch threads are fixed for the session, never derived from the load: pytest-xdist workers share the cores, each
# gets its share (oversubscribed OpenMP pools wait on each other and run many times slower); else torch's default.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True)
def _threads_as_found():
    """Each test leaves torch's thread count as it found it: a job run in this process sets its own (``threads=1``;
    ``auto``: the cores minus the load), which would otherwise carry into whichever test a worker runs next."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


class StubTokenizer:
    """Enough of a tokenizer for the engine: decode ids to a string."""

    chat_template = None
    unk_token_id = None
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def tiny_model(family: str = "llama", n_kv: int = 2, n_q: int = 4, layers: int = 2, seed: int = 0, **extra):
    """A tiny random causal LM of ``family`` (llama, mistral, qwen2, qwen3, gemma2, gemma3) on CPU, float32."""
    import transformers as tf

    from kvbench.engine.attention import ATTN_IMPLEMENTATION, register

    torch.manual_seed(seed)
    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=n_q, num_key_value_heads=n_kv, max_position_embeddings=1024, head_dim=16,
    )
    common.update(extra)
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
    }[family]
    if family in ("gemma2", "gemma3"):
        common.setdefault("sliding_window", 8)
        common.setdefault("query_pre_attn_scalar", 16)
    if family == "gemma3":
        common.setdefault("layer_types", ["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2))
    config = cfg_cls(**common)
    config._attn_implementation = "sdpa"
    model = model_cls(config).eval()
    register()
    return model


def loaded_for(model, name: str = "tiny"):
    """Wrap a tiny model as a kvbench LoadedModel using the kvbench attention function."""
    from kvbench.engine.attention import ATTN_IMPLEMENTATION
    from kvbench.engine.models import LoadedModel, head_layout

    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return LoadedModel(
        model=model, tokenizer=StubTokenizer(), layout=head_layout(model.config, name), device=torch.device("cpu"),
        dtype=torch.float32, stop_ids=[], chat_template=False, max_input_length=1024, source="tiny",
    )


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared benchmark data not found at {SHARED_DATA}")
    return SHARED_DATA

