"""A sample's token ids and stop ids, as the official scripts build them."""

from dataclasses import replace
from typing import Any

from eval.base import Sample
from methods.base import PromptFormat

from kvbench.engine.models import CHAT_FORMATS


def prompt_text(loaded: Any, sample: Sample) -> tuple[str, dict]:
    """The text the tokenizer encodes for a sample and the call's keywords, as LongBench's ``pred.py`` builds it."""
    tok, fmt = loaded.tokenizer, loaded.chat_template if sample.chat else None
    if fmt == "tokenizer" or fmt is True:
        return tok.apply_chat_template([{"role": "user", "content": sample.prompt}], add_generation_prompt=True,
                                       tokenize=False), {"add_special_tokens": False}
    return (CHAT_FORMATS[fmt].format(prompt=sample.prompt) if fmt in CHAT_FORMATS else sample.prompt), {}


def encode_prompt(loaded: Any, sample: Sample) -> list[int]:
    """Token ids of a sample's prompt: ``sample.ids``, else :func:`prompt_text` tokenized."""
    if sample.ids is not None:
        return list(sample.ids)
    text, kwargs = prompt_text(loaded, sample)
    return [int(i) for i in loaded.tokenizer(text, **kwargs)["input_ids"]]


def prompt_format(loaded: Any) -> PromptFormat:
    """The model's :class:`~methods.base.PromptFormat`: the ids around a chat sample's text, the tokenizer's encode."""
    ids, q = split_prompt(loaded, Sample(id="", dataset="", prompt="", max_new_tokens=0, answers=[]), "context")
    encode = lambda s: [int(i) for i in loaded.tokenizer(s, add_special_tokens=False)["input_ids"]]  # noqa: E731
    return PromptFormat(encode, tuple(ids[: len(ids) - q]), tuple(ids[len(ids) - q :]))


def split_prompt(loaded: Any, sample: Sample, compress: str = "prompt") -> tuple[list[int], int]:
    """``(ids, q)``: the ids to prefill and, under ``task.compress=context``, the length of the query part at their
    end, tokenized apart as kvpress's pipeline does (else 0)."""
    if compress != "context":
        return encode_prompt(loaded, sample), 0
    if sample.ids is not None:  # the task's own ids (SCBench's cut ones) end in the query part, tokenized alone
        return list(sample.ids), len(loaded.tokenizer(sample.query, add_special_tokens=False)["input_ids"])
    mark = "\ue000"  # a private-use character: in no template or prompt
    cut = len(sample.prompt) - len(sample.query)
    text, kwargs = prompt_text(loaded, replace(sample, prompt=sample.prompt[:cut] + mark + sample.prompt[cut:]))
    head, tail = text.split(mark)
    ids = [int(i) for i in loaded.tokenizer(head, **kwargs)["input_ids"]]
    query = [int(i) for i in loaded.tokenizer(tail, add_special_tokens=False)["input_ids"]]
    return ids + query, len(query)


def stop_ids_for(loaded: Any, sample: Sample) -> list[int]:
    """The model's stop ids; with stop strings instead the eos id and each one's last token id (LongBench samsum)."""
    if not sample.stop_strings:
        return list(loaded.stop_ids)
    eos = getattr(loaded.tokenizer, "eos_token_id", None)
    return [eos] * (eos is not None) + [loaded.tokenizer.encode(s, add_special_tokens=False)[-1] for s in sample.stop_strings]
