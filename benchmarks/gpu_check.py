"""The GPU check (issue #32): one short script, no downloads, a random model shaped like Llama-3.1-8B.

    python -m benchmarks.gpu_check                     # CUDA: 4 layers of Llama-3.1-8B, 32k and 128k tokens
    python -m benchmarks.gpu_check --device cpu        # small sizes (what CI runs)

Checks and measures, printing a table and writing ``<out>/gpu_check.json``:
* the cache dtype (bf16 on CUDA);
* every registered method compresses and decodes (synthetic head / layer scores where it needs them);
* the first decode step's logits equal the float32 reference attention's (kvbench.attention.grouped_attention)
  within bf16 rounding, and give the same token;
* decode ms/step and peak memory, full cache vs 25 % (SnapKV, SelKV, AdaKV) at each length;
* LOOK-M's compression time at the first length;
* which decode attention each method used (:func:`kvbench.attention.decode_backend`): ``sdpa`` /
  ``sdpa, bias columns`` (no mask: flash eligible), ``flash varlen`` or ``sdpa per head`` (per-head lengths).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from kvbench.cli import ArgParser

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
             vocab_size=1024, max_position_embeddings=4096)


def build(device: torch.device, layers: int):
    """A random Llama-3.1-8B-shaped model (``SMALL`` on CPU) as a :class:`kvbench.models.LoadedModel`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.attention import ATTN_IMPLEMENTATION, register
    from kvbench.models import LoadedModel, head_layout

    register()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, **(LLAMA31_8B if device.type == "cuda" else SMALL))
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return ""

    return LoadedModel(model=model, tokenizer=Tok(), layout=head_layout(config, "random"), device=device, dtype=dtype,
                       stop_ids=[], chat_template=None, max_input_length=config.max_position_embeddings, source="random")


def method(name: str, layout):
    """Method ``name`` with its defaults; synthetic artifacts for the methods that read score files."""
    from methods import get_method_class

    cls = get_method_class(name)
    g = torch.Generator().manual_seed(0)
    L, hq, hkv = layout.num_layers, layout.num_q_heads, layout.num_kv_heads
    artifacts = {"ranking": [torch.randperm(hq, generator=g).tolist() for _ in range(L)],
                 "layer_scores": torch.rand(L, generator=g, dtype=torch.float64),
                 "kv_head_scores": torch.rand(L, hkv, generator=g)} if name in ("headkv", "compresskv") else None
    return cls(cls.Config(), layout, artifacts)


def run(loaded, name: str, n: int, new_tokens: int, budget: float = 0.25, reference: bool = False) -> dict:
    """One generation: its record, decode ms/step, peak memory, the first step's logits, the decode attention."""
    from kvbench.attention import decode_backend
    from kvbench.engine import Engine

    engine = Engine(loaded, method(name, loaded.layout), 1.0 if name == "full" else budget)
    engine.record_logits, engine.reference_decode = True, reference
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
    ids = torch.randint(100, loaded.model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    result = engine.generate(ids, new_tokens, stop_ids=[])
    state = engine.last_state
    backends = sorted({decode_backend(layer, layer.keys, reference) for layer in state.cache.layers})
    cache = state.cache.layers[0].keys
    return {"method": name, "tokens": n, "cache_dtype": str(cache.dtype).replace("torch.", ""),
            "compressed": result.compressed, "compress_s": round(result.compress_s, 4),
            "decode_ms_step": round(1000 * result.decode_s / max(1, result.generated_tokens), 3),
            "peak_memory_mb": round(result.peak_rss_bytes / 2**20, 1),
            "decode_attention": " + ".join(backends),
            "first_logits": engine.last_logits[1] if len(engine.last_logits) > 1 else engine.last_logits[0]}


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns 1 when a method failed or a first step differed from the reference."""
    from methods import available

    p = ArgParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, help="decoder layers (default: 4 on CUDA, 2 on CPU)")
    p.add_argument("--lengths", type=int, nargs="+", help="prompt tokens (default: 32768 131072 on CUDA, 256 512 on CPU)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    lengths = args.lengths or ([32768, 131072] if cuda else [256, 512])
    loaded = build(device, args.layers or (4 if cuda else 2))
    rows, failures, n0 = [], [], lengths[0]
    for name in available():  # every method runs, and its first decode step equals the float32 reference's
        try:
            fast, ref = run(loaded, name, n0, 2), run(loaded, name, n0, 2, reference=True)
            a, b = fast.pop("first_logits").float(), ref.pop("first_logits").float()
            fast["first_step_max_abs_diff"] = round(float((a - b).abs().max()), 5)
            fast["first_step_same_token"] = bool(a.argmax() == b.argmax())
            if not fast["first_step_same_token"] or fast["first_step_max_abs_diff"] > (0.1 if cuda else 1e-4):
                failures.append(f"{name}: first decode step differs from the float32 reference")
            rows.append({"check": "method", **fast})
        except Exception as e:  # noqa: BLE001 - reported, the check goes on
            failures.append(f"{name}: {type(e).__name__}: {e}")
    for n in lengths:  # decode speed and memory, full vs 25 %
        for name in ("full", "snapkv", "selkv", "adakv"):
            r = run(loaded, name, n, args.new_tokens)
            r.pop("first_logits")
            rows.append({"check": "decode", **r})
    r = run(loaded, "lookm", n0, 1)
    r.pop("first_logits")
    rows.append({"check": "lookm_compression", **r})
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({"device": name, "time": time.strftime("%Y-%m-%d %H:%M"),
                                                    "rows": rows, "failures": failures}, indent=1))
    cols = ("check", "method", "tokens", "cache_dtype", "compress_s", "decode_ms_step", "peak_memory_mb", "decode_attention")
    print(f"gpu_check on {name}\n" + " | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))
    print("\n".join(f"FAIL {f}" for f in failures) or "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
