"""Official chat formats (issue #31.1): LongChat gets FastChat's vicuna conversation, as LongBench's pred.py."""

import json

import pytest

from eval.base import Sample
from eval.longbench import build_prompt
from kvbench.job.run import encode_prompt
from kvbench.engine.models import chat_format
from methods.base import ConfigError


class Recorder:
    """A tokenizer that records the text it is given (ids: one per character) and has no chat template."""

    chat_template = None

    def __call__(self, text):
        self.text = text
        return {"input_ids": [1] + [ord(c) % 100 for c in text]}  # BOS, as the slow Llama tokenizer adds


class Loaded:
    def __init__(self, fmt):
        self.tokenizer, self.chat_template = Recorder(), fmt


def test_vicuna_prompt_of_a_longbench_sample_is_fastchats_string(shared_data):
    row = json.loads((shared_data / "longbench" / "multi_news.jsonl").read_text().splitlines()[0])
    prompt = build_prompt("multi_news", row)
    loaded = Loaded("vicuna")
    ids = encode_prompt(loaded, Sample(id="multi_news/0", dataset="multi_news", prompt=prompt, max_new_tokens=8, answers=[]))
    assert loaded.tokenizer.text == ("A chat between a curious user and an artificial intelligence assistant. The assistant "
                                     "gives helpful, detailed, and polite answers to the user's questions. USER: "
                                     + prompt + " ASSISTANT:")
    assert ids[0] == 1 and len(ids) == len(loaded.tokenizer.text) + 1
    raw = Loaded("vicuna")  # a no-template dataset (trec, lcc...): the raw prompt
    encode_prompt(raw, Sample(id="x", dataset="lcc", prompt="code", max_new_tokens=8, answers=[], chat=False))
    assert raw.tokenizer.text == "code"


def test_a_tokenizer_without_a_template_is_an_error_unless_the_format_is_named():
    with pytest.raises(ConfigError, match=r"^model\.chat_template=true: .* accepted values are vicuna .* or none"):
        chat_format({"source": "lmsys/longchat-7b-v1.5-32k", "chat_template": True}, Recorder())
    assert chat_format({"chat_template": "none"}, Recorder()) is None
    assert chat_format({"chat_template": False}, Recorder()) is None
    assert chat_format({"chat_template": "vicuna"}, Recorder()) == "vicuna"
