"""Greedy decoding applies the model's generation_config processors as model.generate does (issue #31.2)."""

import torch

from kvbench.engine.generate import Engine
from kvbench.engine.models import greedy_processors
from methods.full import FullCache
from tests.conftest import loaded_for, tiny_model


def test_repetition_penalty_tokens_equal_model_generate():
    model = tiny_model("llama", seed=3)
    model.generation_config.repetition_penalty = 1.8
    model.generation_config.no_repeat_ngram_size = 2
    prompt = [5, 9, 5, 9, 5, 9, 17, 3]
    loaded = loaded_for(model)
    loaded.processors = greedy_processors(model)
    assert {type(p).__name__ for p in loaded.processors} == {"RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor"}
    ours = Engine(loaded, FullCache(), 1.0).generate(prompt, 12, stop_ids=[]).tokens
    model.set_attn_implementation("sdpa")
    ref = model.generate(torch.tensor([prompt]), do_sample=False, num_beams=1, max_new_tokens=12, min_new_tokens=12,
                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref
    loaded.processors = []  # model.generation_config=false: the plain argmax, which repeats here
    plain = Engine(loaded_for(model), FullCache(), 1.0).generate(prompt, 12, stop_ids=[]).tokens
    assert plain != ours
