"""``task.compress=context`` (issue #39.1): the prompt's context is compressed, its query part (``Sample.query`` and
the chat template's closing) prefilled on top uncompressed; ``compressed_tokens`` beside ``prompt_tokens``; the
setting is part of the job's identity, ``prompt`` (the default) keeping the folders stored before it existed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eval.base import Sample
from kvbench.job.run import encode_prompt, split_prompt
from tests.kvbench.cli_util import byte_tokenizer

# SmolLM2's template shape, and Llama 3's (it trims the content)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRIMMED = ("<s>{% for m in messages %}<|start|>{{ m['role'] }}<|end|>\n\n{{ m['content'] | trim }}<|eot|>{% endfor %}"
           "{% if add_generation_prompt %}<|start|>assistant<|end|>\n\n{% endif %}")


def loaded_with(template):
    tok = byte_tokenizer()  # one token per byte: the boundary is known exactly
    tok.chat_template = template
    return SimpleNamespace(tokenizer=tok, chat_template="tokenizer" if template else None)


@pytest.mark.parametrize("template,closing", [(CHATML, "<|im_end|>\n<|im_start|>assistant\n"),
                                              (TRIMMED, "<|eot|><|start|>assistant<|end|>\n\n"), (None, "")])
def test_the_query_part_is_the_query_and_the_templates_closing(template, closing):
    loaded = loaded_with(template)
    sample = Sample(id="s", dataset="d", prompt="  A long context. Question: why?", query=" Question: why?",
                    max_new_tokens=1, answers=[], chat=template is not None)
    ids, q = split_prompt(loaded, sample, "context")
    assert ids == encode_prompt(loaded, sample) and split_prompt(loaded, sample) == (ids, 0)
    assert loaded.tokenizer.decode(ids[len(ids) - q:]) == " Question: why?" + closing
    empty = split_prompt(loaded, Sample(**{**sample.__dict__, "query": ""}), "context")[1]
    assert empty == len(closing.encode())  # no query: the closing alone stays out, as kvpress's compress_questions


def test_context_and_prompt_jobs_differ_in_folder_and_compressed_tokens(tiny_model_dir, haystack_dir, tmp_path):
    from kvbench.job.run import run_jobs
    from tests.kvbench.cli_util import check, job_dir, read_lines, tiny_model_args

    args = [*tiny_model_args(tiny_model_dir), f"task.haystack_dir={haystack_dir}", "task.context_lengths=[300]",
            "task.depth_percents=[50]", "task.max_new_tokens=3", "quiet=true", "threads=1", "method=snapkv",
            "budget=0.25", f"output_root={tmp_path}"]
    prompt, context = check(args), check([*args, "task.compress=context"])
    assert "compress" not in prompt.identity["task"] and context.identity["task"]["compress"] == "context"
    assert run_jobs([prompt]) + run_jobs([context]) == [0, 0] and job_dir(args) != job_dir([*args, "task.compress=context"])
    (p,), (c,) = (read_lines(job_dir(a) / "predictions.jsonl") for a in (args, [*args, "task.compress=context"]))
    assert p["prompt_tokens"] == p["compressed_tokens"] == c["prompt_tokens"] == 300
    query = len(" </book>.\nBased on the content of the book, answer the question: "
                "What is the best thing to do in San Francisco?".encode())
    assert c["compressed_tokens"] == 300 - query and c["kept_tokens"]["mean"] == int(0.25 * (300 - query))
    # shared prefill: a sweep's jobs prefill the context once and each its query part, as alone
    shared = [check([*args, "task.compress=context", f"output_root={tmp_path / 'shared'}", f"method={m}"])
              for m in ("snapkv", "streamingllm")]
    assert run_jobs(shared) == [0, 0]
    (s,) = read_lines(job_dir([*args, "task.compress=context", f"output_root={tmp_path / 'shared'}"]) / "predictions.jsonl")
    drop = ("prefill_s", "compress_s", "decode_s", "decode_tok_s", "peak_prefill_bytes", "peak_decode_bytes")
    assert {k: v for k, v in s.items() if k not in drop} == {k: v for k, v in c.items() if k not in drop}


def test_compiled_decode_after_a_query_part_equals_eager():
    from kvbench.engine.generate import Engine
    from methods import build_method
    from tests.conftest import loaded_for, tiny_model

    loaded = loaded_for(tiny_model("llama", layers=2))
    ids = torch.randint(0, 128, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine(loaded, build_method({"name": "adakv"}, loaded.layout), 0.5)
    eager = engine.generate(ids, 6, stop_ids=[], query_tokens=9)
    engine.compile_decode = True
    compiled = engine.generate(ids, 6, stop_ids=[], query_tokens=9)
    assert compiled.decode_compiled and compiled.tokens == eager.tokens and len(eager.tokens) == 6
