"""The GPU check (issue #41): one command, no network, random models shaped like Llama-3.1-8B.

    timeout 480 python benchmarks/gpu_check.py --out $OUT    # CUDA: 32 layers, vocabulary 32768, 32k and 128k
    python benchmarks/gpu_check.py --device cpu              # tiny shapes (what CI runs)

Writes ``<out>/gpu_check.json`` after each part (a timeout keeps what was measured) and prints a table. The parts
(``sdpa``, ``engine``, ``compiled``, ``varlen``, ``lookm``, ``quant``, ``kvpress``, ``throughput``) and what their rows settle:
docs/PERFORMANCE.md.
Exit 1 when a part failed or an error exceeded its tolerance.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch

if __package__ in (None, ""):  # python benchmarks/gpu_check.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import quant, throughput  # noqa: E402
from kvbench.cli import ArgParser  # noqa: E402

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  vocab_size=32768, rope_theta=500000.0, max_position_embeddings=131072 + 256,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
             vocab_size=1024, max_position_embeddings=4096)
DECODE_METHODS = ("full", "snapkv", "selkv", "adakv")
#: relative tolerance of logits and attention outputs against the float32 reference: bf16 rounding, float32 order
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def build(device: torch.device, layers: int):
    """A random Llama-3.1-8B-shaped model (``SMALL`` on CPU) in bf16 (float32 on CPU) as a LoadedModel."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.engine.attention import ATTN_IMPLEMENTATION, register
    from kvbench.engine.models import LoadedModel, head_layout

    register()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, **(LLAMA31_8B if device.type == "cuda" else SMALL))
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype).eval()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "",  # KVzip's repeat prompt: a byte per character
                          encode=lambda text, add_special_tokens=False: [b % config.vocab_size for b in text.encode()])
    return LoadedModel(model=model, tokenizer=tok, layout=head_layout(config, "random"), device=device, dtype=dtype,
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn):
    """``(ms, fn())``: the call's milliseconds, the device synchronised before and after."""
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return 1000 * (time.perf_counter() - t), out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| relative to the spread of b (logits of a random model are nearly uniform: not |b|)."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / (b - b.mean(-1, keepdim=True)).abs().max().clamp_min(1e-12))


def sdpa_part(device, dtype, lengths: list[int], steps: int = 16) -> list[dict]:
    """PyTorch's choice and ms/call for decode-shaped SDPA (8 KV heads, 4 query rows each) as T grows by one."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from kvbench.engine.attention import DECODE_BACKENDS, sdpa_backend

    rows = []
    for n in lengths:
        for width in (128, 136, 264):  # head dim; + a bias column (padded to 8); head dim 256 + a bias column
            buf, q = torch.randn(1, 8, n + steps, width, device=device, dtype=dtype), torch.randn(1, 8, 4, width, device=device, dtype=dtype)
            row = {"part": "sdpa", "tokens": n, "width": width}
            for label, backends in (("default", None), ("kvbench", DECODE_BACKENDS)):
                with sdpa_kernel(backends) if backends else nullcontext():
                    row[f"{label}_choice"] = sdpa_backend(q, buf[:, :, :n], buf[:, :, :n])
                    times = [_timed(device, lambda k=buf[:, :, : n + i]: F.scaled_dot_product_attention(q, k, k))[0]
                             for i in range(steps)]
                    row[f"{label}_step_ms"] = [round(x, 3) for x in times]
            rows.append(row)
    return rows


def engine_part(loaded, names, n: int, new_tokens: int, compiled: bool = False, reference: bool = True) -> list[dict]:
    """One shared prefill of n random tokens for each method (and its float32-reference twin); each decodes."""
    from kvbench.engine.generate import Engine, prefill
    from methods.base import ConfigError

    dev, tol = loaded.device, TOLERANCE[loaded.dtype]
    ids = torch.randint(100, loaded.model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    engines, rows = {}, []
    for name in names:
        for ref in (False, True) if reference else (False,):
            try:
                e = engines[name, ref] = Engine(loaded, method(name, loaded.layout), 1.0 if name == "full" else 0.25)
            except ConfigError as err:  # an optional dependency missing (kvpress_press without kvpress): said, not failed
                rows.append({"part": "engine", "method": name, "tokens": n, "skipped": str(err)})
                break
            e.reference_decode, e.record_logits, e.compile_decode = ref, True, compiled and not ref
    parts = dict(zip(engines, prefill(list(engines.values()), ids, new_tokens)))
    for name in dict.fromkeys(name for name, _ in engines):
        marks: list[float] = []

        def mark(step):
            _sync(dev)
            marks.append(time.perf_counter())

        fast = engines[name, False]
        fast.on_decode_step = mark
        r = fast.generate(ids, new_tokens, stop_ids=[], prefilled=parts.pop((name, False)))
        steps = [1000 * (b - a) for a, b in zip(marks, marks[1:])]
        row = {"part": "compiled" if compiled else "engine", "method": name, "tokens": n, "compressed": r.compressed,
               "prefill_s": round(r.prefill_s, 3), "compress_s": round(r.compress_s, 4), "compile_s": round(r.compile_s, 2),
               "decode_compiled": r.decode_compiled, "compile_error": fast.compile_error, "decode_ms_step_median": round(statistics.median(steps[2:] or steps), 3),
               "step_ms": [round(s, 3) for s in steps], "peak_prefill_bytes": r.peak_prefill_bytes,
               "peak_decode_bytes": r.peak_decode_bytes, "cache_bytes_after": r.cache_bytes_after,
               "sdpa_backends": r.sdpa_backends}
        if reference:
            ref = engines[name, True]
            ref.generate(ids, min(new_tokens, 8), stop_ids=[], prefilled=parts.pop((name, True)))
            a, b = torch.stack(fast.last_logits[: len(ref.last_logits)]), torch.stack(ref.last_logits)
            row.update(logits_rel_err=round(_rel(a, b), 6), same_argmax_steps=int((a.argmax(-1) == b.argmax(-1)).sum()),
                       steps_compared=len(b), tolerance=tol, ok=_rel(a, b) <= tol)
            ref.last_state = ref.last_logits = None
        fast.last_state, fast.last_logits = None, []  # free this method's cache before the next decodes
        rows.append(row)
    return rows


def _ragged(device, dtype, h_kv: int, d: int, n: int, bias: int, g: torch.Generator):
    """A layer with random per-head lengths of n prompt slots (``bias`` columns), one token decoded."""
    from kvbench.engine.kvcache import PreallocatedLayer, store_layer, write_bias

    keys, values = (torch.randn(1, h_kv, n, d, generator=g).to(device, dtype) for _ in range(2))
    valid = (torch.rand(1, h_kv, n, generator=g) < torch.rand(1, h_kv, 1, generator=g).clamp(0.2, 0.9)).to(device)
    layer = store_layer(SimpleNamespace(layers=[PreallocatedLayer(2)]), 0, keys, values, valid, bias, d**-0.5, 2)
    if bias:
        write_bias(layer, torch.randn(1, h_kv, n, generator=g).to(device), d, valid)
    k1 = torch.randn(1, h_kv, 1, d, generator=g).to(device, dtype)
    layer.update(k1, k1)
    return layer


def varlen_part(device, dtype, n: int, batch: int = 4) -> list[dict]:
    """Decode attention over per-head lengths (:class:`kvbench.engine.kvcache.RaggedLayer`) against float32 reference
    attention, for (query heads, KV heads, head dim, bias columns) of Llama (GQA 4), Qwen (GQA 5), MHA, head dim 256;
    then ``batch`` rows of Llama's shape in one call, as a decode batch attends them
    (:func:`kvbench.engine.kvcache.stack_ragged`): its ms (stacking included) and the rows' calls' one by one."""
    from kvbench.engine.attention import _decode_attention, decode_backend, dense_layer, grouped_attention
    from kvbench.engine.kvcache import stack_ragged

    def attend(query, layers):  # B rows: one call over their stacked layers
        s = stack_ragged(layers) if len(layers) > 1 else layers[0]
        return _decode_attention(query, s.keys, s.values, None, query.shape[-1] ** -0.5, None, s)

    rows, g = [], torch.Generator().manual_seed(0)
    shapes = ((32, 8, 128, 0, 1), (40, 8, 128, 0, 1), (32, 32, 128, 0, 1), (16, 4, 256, 0, 1), (16, 4, 256, 1, 1))
    for h_q, h_kv, d, bias, b in (*shapes, (32, 8, 128, 0, batch)):
        row = {"part": "varlen", "query_heads": h_q, "kv_heads": h_kv, "head_dim": d, "bias_columns": bias, "rows": b}
        try:
            layers = [_ragged(device, dtype, h_kv, d, n, bias, g) for _ in range(b)]
            query = torch.randn(b, h_q, 1, d, generator=g).to(device, dtype)
            out, queries = attend(query, layers), query.split(1)
            ref = torch.cat([grouped_attention(q.float(), k.float(), v.float(), d**-0.5, bias=dense)
                             for q, x in zip(queries, layers) for k, v, dense in [dense_layer(x, x.keys, x.values, q)]])
            err = _rel(out, ref)
            row.update(backend=decode_backend(layers[0], layers[0].keys), rel_err=round(err, 6),
                       ok=err <= TOLERANCE[dtype])
            if b > 1:  # the faster of 3 calls each
                row.update(ms=round(min(_timed(device, lambda: attend(query, layers))[0] for _ in range(3)), 3),
                           rows_one_by_one_ms=round(min(_timed(device, lambda: [attend(q, [x]) for q, x in zip(
                               queries, layers)])[0] for _ in range(3)), 3))
        except Exception as e:  # noqa: BLE001 - reported (a kernel's shape limit), the check goes on
            row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", ok=False)
        rows.append(row)
    return rows


def lookm_part(loaded, n: int) -> list[dict]:
    """LOOK-M's whole-prompt score (:func:`methods.lookm.cumulative_attention`) of one layer on bf16 queries and
    keys (QK^T in bf16, float32 accumulation) against the float32 path on the same values: ms and relative error."""
    from methods.lookm import cumulative_attention

    c, g = loaded.model.config, torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, h, n, c.head_dim, generator=g).to(loaded.device, torch.bfloat16)
            for h in (c.num_attention_heads, c.num_key_value_heads))
    row, sums = {"part": "lookm", "tokens": n}, {}
    for label, dtype in (("bf16", torch.bfloat16), ("float32", torch.float32)):
        for _ in range(2):  # the second call is timed
            ms, sums[label] = _timed(loaded.device, lambda: cumulative_attention(q.to(dtype), k.to(dtype),
                                                                                 c.head_dim**-0.5, None, 512))
        row[f"{label}_ms"] = round(ms, 3)
    err = float((sums["bf16"] - sums["float32"]).abs().max() / sums["float32"].abs().max())
    return [{**row, "rel_err": err, "ok": err <= TOLERANCE[torch.float32]}]


def kvpress_part(loaded, n: int, new_tokens: int) -> list[dict]:
    """kvpress's SnapKV (25 % kept) on the same model through SDPA: decode ms/step and cache bytes; [] without it."""
    from transformers import DynamicCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = dict(ALL_ATTENTION_FUNCTIONS)  # kvpress wraps every attention function at import
    try:
        import kvpress
    except ImportError:
        return []
    finally:
        ALL_ATTENTION_FUNCTIONS.update(saved)
    from kvbench.engine.generate import cache_bytes

    model, dev, own = loaded.model, loaded.device, loaded.model.config._attn_implementation
    ids = torch.randint(100, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(dev)
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            with kvpress.SnapKVPress(compression_ratio=0.75)(model):
                tok = model(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
            size, steps = cache_bytes(cache), []
            for _ in range(new_tokens):
                ms, tok = _timed(dev, lambda: model(tok, past_key_values=cache).logits[:, -1:].argmax(-1))
                steps.append(ms)
    finally:
        model.set_attn_implementation(own)
    return [{"part": "kvpress", "method": "snapkv", "tokens": n, "kvpress": importlib.metadata.version("kvpress"),
             "decode_ms_step_median": round(statistics.median(steps[2:] or steps), 3), "cache_bytes_after": size}]


def main(argv: list[str] | None = None) -> int:
    """Run the check; returns 1 when a part failed or exceeded its tolerance."""
    from methods import available

    p = ArgParser(prog="python benchmarks/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, help="decoder layers (default: 32 on CUDA, 2 on CPU)")
    p.add_argument("--lengths", type=int, nargs="+", help="prompt tokens (default: 32768 131072 on CUDA, 160 on CPU)")
    p.add_argument("--new-tokens", type=int, help="decode steps per method (default: 64 on CUDA, 6 on CPU)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled-decode part")
    p.add_argument("--out", default="benchmarks/out", help="folder of gpu_check.json (default: benchmarks/out)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # a smoke run on shared cores
    lengths, new = args.lengths or ([32768, 131072] if cuda else [160]), args.new_tokens or (64 if cuda else 6)
    loaded = build(device, args.layers or (32 if cuda else 2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "time": time.strftime("%Y-%m-%d %H:%M"),
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "layers": loaded.layout.num_layers,
              "dtype": str(loaded.dtype), "rows": [], "failures": []}
    parts = [("sdpa", lambda: sdpa_part(device, loaded.dtype, lengths)),
             ("varlen", lambda: varlen_part(device, loaded.dtype, lengths[0])), ("lookm", lambda: lookm_part(loaded, lengths[0]))]
    parts += [(f"engine {n}", lambda n=n: engine_part(loaded, available() if n == lengths[0] else DECODE_METHODS, n, new))
              for n in lengths]
    if not args.no_compile:
        parts.append(("compiled", lambda: engine_part(loaded, ("full", "selkv", "adakv"), lengths[0], new, True, False)))
    parts.append(("quant", lambda: [{"part": "quant", **r, "ok": r["stored_bytes"] == r["analytic_bytes"]} for r in
                                    quant.rows(loaded, [4096, 16384] if cuda else lengths[:1], new)]))
    parts.append(("kvpress", lambda: kvpress_part(loaded, lengths[0], new)))
    parts.append(("throughput", lambda: [  # batched decoding at a cache cap: full vs decode-time compression (#58)
        {"part": "throughput", "method": label, **m} for label, m in throughput.measure(
            loaded, list(range(1, 65)), 1024 if cuda else 256, 8 if cuda else 2)["measured"].items()]))
    for label, part in parts:
        try:
            rows = part()
        except Exception as e:  # noqa: BLE001 - reported, the check goes on
            rows = [{"part": label, "error": f"{type(e).__name__}: {str(e)[:300]}", "ok": False}]
        report["rows"] += rows
        report["failures"] += [f"{label}: {r.get('method') or r.get('head_dim') or ''} {r.get('error', 'over tolerance')}"
                               for r in rows if r.get("ok") is False]
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        if cuda:
            torch.cuda.empty_cache()
    eager = {(r["method"], r["tokens"]): r["decode_ms_step_median"] for r in report["rows"]
             if r["part"] == "engine" and "skipped" not in r}
    print(f"gpu_check on {report['device']}, {report['layers']} layers -> {out / 'gpu_check.json'}\n"
          "part | method | tokens | ms/step (eager) | decode peak MB | cache MB | decode SDPA | logits rel err | compile s")
    for r in report["rows"]:
        if r["part"] == "quant" and "decode_tok_s" in r:  # decode ms/step from tokens/s; the stored cache
            r = {**r, "method": f"full, {r['bits'] or 'dtype'} bits", "decode_ms_step_median": round(1000 / r["decode_tok_s"], 3),
                 "cache_bytes_after": r["stored_bytes"]}
        if r["part"] in ("engine", "compiled", "kvpress", "quant") and "decode_ms_step_median" in r:
            ms = f"{r['decode_ms_step_median']}" + (f" ({eager.get((r['method'], r['tokens']))})" if r["part"] == "compiled" else "")
            print(" | ".join(str(x) for x in (r["part"], r["method"], r["tokens"], ms, round(r.get("peak_decode_bytes", 0) / 2**20),
                                              round(r["cache_bytes_after"] / 2**20, 1), (r.get("sdpa_backends") or {}).get("decode", ""),
                                              r.get("logits_rel_err", ""), r.get("compile_s", ""))))
    tput = {r["method"]: r for r in report["rows"] if r["part"] == "throughput" and "tok_s" in r}
    for label, r in tput.items():  # rows that fit the full cache's cap, their tokens/s, over full
        print(f"throughput | {label} | {r['rows']} rows | {r['tok_s']:.1f} tok/s | {r['tok_s'] / tput['full']['tok_s']:.2f}x")
    print("\n".join(f"FAIL {f}" for f in report["failures"]) or "all checks passed")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
