"""The token ids of a sample: its prompt in the model's format (chat template or an official script's format), the
query part left uncompressed under ``task.compress=context``, and its stop ids, as the official scripts build them."""

from dataclasses import replace
from typing import Any

from eval.base import Sample
from methods.base import PromptFormat

from kvbench.engine.models import CHAT_FORMATS


def prompt_text(loaded: Any, sample: Sample) -> tuple[str, dict]:
    """The text the tokenizer encodes for a sample and the tokenizer call's keywords, as LongBench's ``pred.py`` builds
    it: for a chat sample the tokenizer's chat template (one user turn, generation prompt; its special tokens are in
    the text, none added) or the model's official format (``vicuna``); else the plain prompt."""
    tok, fmt = loaded.tokenizer, loaded.chat_template if sample.chat else None
    if fmt == "tokenizer" or fmt is True:
        return tok.apply_chat_template([{"role": "user", "content": sample.prompt}], add_generation_prompt=True,
                                       tokenize=False), {"add_special_tokens": False}
    return (CHAT_FORMATS[fmt].format(prompt=sample.prompt) if fmt in CHAT_FORMATS else sample.prompt), {}


def encode_prompt(loaded: Any, sample: Sample) -> list[int]:
    """Token ids of a sample's prompt: ``sample.ids``, else :func:`prompt_text` tokenized (chat: the ids of
    ``apply_chat_template(tokenize=True)``)."""
    if sample.ids is not None:
        return list(sample.ids)
    text, kwargs = prompt_text(loaded, sample)
    return [int(i) for i in loaded.tokenizer(text, **kwargs)["input_ids"]]


def prompt_format(loaded: Any) -> PromptFormat:
    """The model's :class:`~methods.base.PromptFormat`: the ids :func:`encode_prompt` puts before and after a chat
    sample's text (for KVzip's repeat prompt), and the tokenizer's ``encode`` without special tokens."""
    mark = "\ue000"  # a private-use character: in no template or prompt
    text, kwargs = prompt_text(loaded, Sample(id="", dataset="", prompt=mark, max_new_tokens=0, answers=[]))
    head, tail = text.split(mark)
    encode = lambda s: [int(i) for i in loaded.tokenizer(s, add_special_tokens=False)["input_ids"]]  # noqa: E731
    return PromptFormat(encode, tuple(int(i) for i in loaded.tokenizer(head, **kwargs)["input_ids"]), tuple(encode(tail)))


def split_prompt(loaded: Any, sample: Sample, compress: str = "prompt") -> tuple[list[int], int]:
    """``(ids, q)``: the ids to prefill and, under ``task.compress=context``, how many of them at the end are the
    query part, left uncompressed (else 0, and ``ids`` are :func:`encode_prompt`'s). The query part is
    ``sample.query`` and, with a chat template, the template's closing and generation prompt, tokenized apart
    (without special tokens) as kvpress's ``KVPressTextGenerationPipeline.preprocess`` does."""
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
    """The model's stop ids; for a sample with stop strings instead the tokenizer's eos id and the last token id of
    each, as LongBench's ``pred.py`` stops samsum: ``eos_token_id=[tokenizer.eos_token_id,
    tokenizer.encode("\\n", add_special_tokens=False)[-1]]`` (that list replaces the model's whole eos list)."""
    if not sample.stop_strings:
        return list(loaded.stop_ids)
    eos = getattr(loaded.tokenizer, "eos_token_id", None)
    return [eos] * (eos is not None) + [loaded.tokenizer.encode(s, add_special_tokens=False)[-1] for s in sample.stop_strings]
