"""SentencePiece-BPE GGUF tokenizers (``tokenizer.ggml.model = llama``, e.g. Gemma 3) are rebuilt
as BPE models that tokenize as llama.cpp does (kvbench.engine.models.gguf_spm_as_bpe).

transformers' GGUF conversion made Gemma 3 270M's tokenizer a Unigram model from the file's
scores (BPE merge priorities), which split ``" statements"`` into ``▁st at em ents``. Here a
small vocabulary whose scores make Unigram and BPE disagree is written into a GGUF file (metadata
only); the rebuilt tokenizer must give the token ids of a direct implementation of llama.cpp's
SentencePiece algorithm: merge the adjacent pair whose concatenation is the highest-scored
normal piece, leftmost first, until none is left; characters outside the vocabulary become
their UTF-8 bytes' ``<0xXX>`` pieces.
"""

from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf")
from tokenizers import Tokenizer, normalizers  # noqa: E402
from tokenizers.models import BPE, Unigram  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from kvbench.engine.models import _gguf_fields, gguf_spm_as_bpe, spm_bpe_merges  # noqa: E402

NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
# (piece, score): long pieces have low scores (late merges), as in a SentencePiece BPE model
PIECES = [("▁", -1.0), ("s", -2.0), ("t", -2.0), ("a", -2.0), ("e", -2.0), ("m", -2.0), ("n", -2.0),
          ("at", -3.0), ("▁s", -4.0), ("▁st", -5.0), ("en", -6.0), ("em", -7.0), ("ts", -8.0), ("ents", -9.0),
          ("ate", -10.0), ("ement", -11.0), ("▁state", -12.0), ("▁statement", -13.0), ("▁statements", -14.0),
          ("me", -15.0), ("ment", -16.0), ("nt", -17.0), ("stat", -18.0), ("ta", -19.0), ("▁sta", -20.0),
          ("▁stat", -21.0), ("ents", -22.0), ("ement", -23.0), ("▁m", -24.0), ("▁t", -25.0), ("▁a", -26.0)]


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens, scores, types = ["<unk>", "<s>"], [0.0, 0.0], [UNKNOWN, CONTROL]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>"), scores.append(0.0), types.append(BYTE)
    seen = set()
    for piece, score in PIECES:
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece), scores.append(score), types.append(NORMAL)
    return tokens, scores, types


def llama_cpp_spm(text: str, tokens: list[str], scores: list[float], types: list[int]) -> list[int]:
    """llama.cpp's SentencePiece tokenization, written directly (spaces as ▁, no space prefix)."""
    ids = {t: i for i, t in enumerate(tokens)}
    symbols = list(text.replace(" ", "▁"))
    while True:
        best = None
        for i in range(len(symbols) - 1):
            piece = symbols[i] + symbols[i + 1]
            if piece in ids and types[ids[piece]] == NORMAL and (best is None or scores[ids[piece]] > best[0]):
                best = (scores[ids[piece]], i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    out = []
    for sym in symbols:
        out += [ids[sym]] if sym in ids else [ids[f"<0x{b:02X}>"] for b in sym.encode("utf-8")]
    return out


@pytest.fixture()
def gguf_file(tmp_path):
    tokens, scores, types = vocabulary()
    path = tmp_path / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def unigram_tokenizer() -> PreTrainedTokenizerFast:
    """What transformers' GGUF conversion builds for such a file: a Unigram model on the scores."""
    tokens, scores, _types = vocabulary()
    backend = Tokenizer(Unigram([(t, s) for t, s in zip(tokens, scores)], unk_id=0, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


TEXTS = ["statements", " statements", " statement stat", "a tea mat", " ments", "sent", "z", " é st"]


def test_rebuilt_tokenizer_tokenizes_as_llama_cpp(gguf_file):
    tokens, scores, types = vocabulary()
    tok = unigram_tokenizer()
    before = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    expected = [llama_cpp_spm(t, tokens, scores, types) for t in TEXTS]
    assert before != expected  # the Unigram reading of the scores differs (the bug)
    assert gguf_spm_as_bpe(tok, _gguf_fields(gguf_file)) is True
    assert isinstance(tok.backend_tokenizer.model, BPE)
    assert [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS] == expected
    assert tok.convert_ids_to_tokens(tok(" mat", add_special_tokens=False)["input_ids"]) == ["▁m", "at"]
    assert tok.convert_ids_to_tokens(tok("é", add_special_tokens=False)["input_ids"]) == ["<0xC3>", "<0xA9>"]
    assert gguf_spm_as_bpe(tok, _gguf_fields(gguf_file)) is False  # already BPE: left as it is


def test_merges_are_ranked_by_the_merged_pieces_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc", "<0x41>"]
    merges = spm_bpe_merges(tokens, [0, 0, 0, -2.0, -1.0, -3.0, 0], [NORMAL] * 6 + [BYTE])
    assert merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]
