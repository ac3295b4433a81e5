"""The hook path of ``method=kvpress`` (docs/METHODS.md): a kvpress press's own code on the Hugging Face model.

kvpress's pipeline prefills under ``with press(model): model.model(context_ids, past_key_values=cache)``: the
press's ``__call__`` registers its forward hooks (and, for KVzip, FastKVzip, KVComposePress, scores with extra
forwards when it exits). :class:`PressHooks` enters that same context around kvbench's prefill forward
(:meth:`methods.base.Method.prefill_hooks`), then reads each compressible layer back from the cache: the keys and
values the press left there, and where it masks instead of evicting (AdaKV-style fake keys: AdaKVPress,
DuoAttention's streaming heads, KVzip, DMS, ...: ``module.masked_key_indices``) its kept set per KV head, stored as
kvbench's per-head lengths (really freed, decoded without fake keys). A press that keeps the shape (ThinKPress zeroes
key channels) keeps its bytes: no saving is recorded that the cache does not hold.

Trained artefacts (:data:`ARTIFACTS`): ``press_kwargs.artifact``, a local folder or file or a Hub id, read before
the model loads, replaces the Hub id kvpress derives from the model's name.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .base import CompressResult, pack_kept


def presses(press: Any) -> list:
    """``press`` and every press nested in it (a wrapper's ``press``/``base_press``, a ComposedPress's ``presses``)."""
    from kvpress import BasePress

    out = [press]
    for f in dataclasses.fields(press):
        value = getattr(press, f.name, None)
        for inner in value if isinstance(value, list) else [value]:
            out += presses(inner) if isinstance(inner, BasePress) else []
    return out


def set_compression_ratio(press: Any, ratio: float) -> None:
    """Set ``compression_ratio`` as kvpress's evaluate.py does: on the press, or on each of a ComposedPress's;
    presses driven by another knob (ThinK, DuoAttention, DMS: their setter raises AttributeError) keep theirs."""
    for p in getattr(press, "presses", None) or [press]:
        try:
            p.compression_ratio = ratio
        except AttributeError:
            pass


def continues_from_cache(press: Any) -> bool:
    """Whether decoding positions continue from the compressed cache's length, as kvpress's pipeline sets
    ``context_length`` (KeyRerotationPress and FinchPress re-rotate kept keys; RestoreKVPress appends tokens)."""
    import kvpress

    return isinstance(press, (kvpress.KeyRerotationPress, kvpress.RestoreKVPress)) or (
        isinstance(press, kvpress.FinchPress) and press.rerotate_keys)


class PressHooks:
    """``with press(model)`` around one prefill forward, timed, then the compressible layers read back.

    Args:
        press: the kvpress press; its ``compression_ratio`` is set to ``ratio`` first (:func:`set_compression_ratio`).
        model: the Hugging Face causal LM.
        state: the engine's per-sample state (``layout``, ``cache``; ``results`` and ``compress_s`` are written).
        eager: run the prefill with ``attn_implementation="eager"`` (the press reads the attention weights,
            ObservedAttentionPress), kvbench's attention function again on exit.
    """

    def __init__(self, press: Any, model: Any, state: Any, ratio: float, eager: bool):
        self.press, self.model, self.state, self.ratio, self.eager = press, model, state, ratio, eager
        language = model.model.language_model if hasattr(model.model, "language_model") else model.model
        self.modules = [layer.self_attn for layer in language.layers]
        self.hook_s, self.own = 0.0, model.config._attn_implementation

    def _now(self) -> float:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _hook(self, module: Any, args: Any, kwargs: dict, output: Any) -> Any:
        """The press's forward hook on compressible layers only (kvbench leaves sliding-window layers whole)."""
        if module.layer_idx not in self.state.layout.compressible_layers:
            return output
        t0 = self._now()
        output = type(self.press).forward_hook(self.press, module, args, kwargs, output)
        self.hook_s += self._now() - t0
        return output

    def __enter__(self) -> PressHooks:
        t0 = self._now()
        set_compression_ratio(self.press, self.ratio)
        for module in self.modules:  # what kvpress's attention patch resets at each prefill
            module.masked_key_indices = None
        self.press.forward_hook = self._hook  # the press's __call__ registers self.forward_hook
        if self.eager:
            self.model.set_attn_implementation("eager")
        self.context = self.press(self.model)
        try:
            self.context.__enter__()
        except BaseException:
            self._restore()
            raise
        self.state.compress_s += self._now() - t0
        return self

    def _restore(self) -> None:
        del self.press.forward_hook
        if self.eager:
            self.model.set_attn_implementation(self.own)

    def __exit__(self, *exc: Any) -> bool:
        t0, in_forward = self._now(), self.hook_s
        try:
            suppress = self.context.__exit__(*exc)  # KVzip, FastKVzip, KVCompose score and evict here
        finally:
            self._restore()
        if exc[0] is None:
            self.read_back()
        for module in self.modules:
            del module.masked_key_indices
        self.state.compress_s += in_forward + self._now() - t0
        return bool(suppress)

    def read_back(self) -> None:
        """``state.results[layer]`` for each compressible layer: the cache's keys/values ``(B, H_kv, m, d)``; where the
        press masked ``module.masked_key_indices`` (batch, head, position), the kept slots per head (``valid``)."""
        rerotated = continues_from_cache(self.press)
        for i in self.state.layout.compressible_layers:
            keys, values = self.state.cache.layers[i].keys, self.state.cache.layers[i].values
            masked = self.modules[i].masked_key_indices
            if masked is not None:
                keep = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
                keep[tuple(t.to(keys.device) for t in masked)] = False
                result = pack_kept(keys, values, keep)
                result.stats["masked_tokens"] = float((~keep).sum())  # freed here, masked by kvpress
            else:
                result = CompressResult(keys, values)
            result.next_position = keys.shape[2] if rerotated else None
            self.state.results[i] = result


# --- trained artefacts -----------------------------------------------------------------------------------------


def _duo_pattern(press: Any, src: Path) -> None:
    """A DuoAttention pattern folder (the DuoAttention repository's ``attn_patterns/<model>/<run>/``):
    ``config.json`` (``sink_size``, ``recent_size``) and ``full_attention_heads.tsv`` (L rows × H_kv head scores),
    the scores clipped to [0, 1] as DuoAttention's ``load_attn_pattern``."""
    import numpy as np

    config = json.loads((src / "config.json").read_text())
    scores = np.clip(np.loadtxt(src / "full_attention_heads.tsv", delimiter="\t", ndmin=2), 0, 1)
    pattern = int(config["sink_size"]), int(config["recent_size"]), scores
    press.load_attention_pattern = lambda model: pattern


def _qfilters(press: Any, src: Path) -> None:
    from kvpress.presses.qfilter_press import QFilters

    filters = QFilters.from_pretrained(str(src)).q_filters
    press.load_q_filters = lambda model_name: filters


def _kvzap(press: Any, src: Path) -> None:
    from kvpress.presses.kvzap_press import KVzapModel

    press.kvzap_model, press.kvzap_model_name = KVzapModel.from_pretrained(str(src)), str(src)
    press.post_init_from_model = lambda model: None  # kvpress would load nvidia/KVzap-<type>-<model name>


def _stats(press: Any, src: Path) -> None:
    from kvpress.presses.expected_attention_with_stats import ExpectedAttentionStats

    ExpectedAttentionStats.from_pretrained(str(src))  # read now: a bad folder stops the job before the model loads
    press.stats_folder = str(src)


def _lukv_curve(press: Any, src: Path) -> None:
    import numpy as np

    with open(src, "rb") as f:  # a .npy array, never pickled objects
        press._budget_curves = np.lib.format.read_array(f, allow_pickle=False)  # (99, L, H_kv)


#: press class -> (what kvpress fetches from the network by the model's name, installer of a local copy)
ARTIFACTS: dict[str, tuple[str, Callable[[Any, Path], None] | None]] = {
    "DuoAttentionPress": ("its attention pattern (mit-han-lab/duo-attention on GitHub)", _duo_pattern),
    "QFilterPress": ("its Q-filters (Hub: nthngdy/<model>_qfilt)", _qfilters),
    "KVzapPress": ("its KVzap model (Hub: nvidia/KVzap-<type>-<model>)", _kvzap),
    "ExpectedAttentionStatsPress": ("its query statistics (Hub: alessiodevoto/exp_att_stats_...)", _stats),
    "LUKVPress": ("its budget curve (baidu-baige/LU-KV on GitHub)", _lukv_curve),
    "FastKVzipPress": ("its gates (Hub: Jang-Hyun/Fast-KVzip)", None),
    "RestoreKVPress": ("its LoRA adapter and restore embeddings (Hub: higokri/RestoreKV-<model>)", None),
}


def install_artifact(press: Any, src: str) -> None:
    """Install ``src`` (a local folder/file, or a Hub id downloaded to the local cache) as ``press``'s artefact.

    Raises:
        OSError, ValueError: unreadable or missing (offline: not in the local Hub cache).
    """
    path = Path(src).expanduser()
    if not path.exists():  # a Hub id
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(src))
    ARTIFACTS[type(press).__name__][1](press, path)
