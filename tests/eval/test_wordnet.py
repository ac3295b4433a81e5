"""eval.wordnet: Debian's wordnet-base as NLTK's WordNet 3.0 (lexnames and index.sense derived), and NLTK's
download layout (a zip on the data path) found as well."""

from __future__ import annotations

import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eval.wordnet import LEXNAMES, install, main
from tests.conftest import ROOT

DEBIAN = Path("/usr/share/wordnet")
pytestmark = pytest.mark.skipif(not (DEBIAN / "data.noun").is_file(),
                                reason="Debian's wordnet-base not installed (bash .ci/wordnet_setup.sh, as root)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("nltk_data")
    assert main(["--source", str(DEBIAN), "--nltk-data", str(root)]) == 0
    return root / "corpora" / "wordnet"


def test_the_derived_files_agree_with_nltks_own_sense_keys_numbers_and_counts(corpus, monkeypatch):
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    monkeypatch.setattr(nltk.data, "path", [str(corpus.parents[1]), *nltk.data.path])  # NLTK reads its data path only

    lexnames = (corpus / "lexnames").read_text().splitlines()
    assert len(lexnames) == 45 == len(LEXNAMES) and lexnames[3] == "03\tnoun.Tops\t1" and lexnames[44] == "44\tadj.ppl\t3"
    index = {}
    for line in (corpus / "index.sense").read_text().splitlines():
        key, offset, number, tags = line.split()
        index[key] = (int(offset), int(number), int(tags))
    wn = WordNetCorpusReader(str(corpus), None)  # NLTK computes each lemma's sense key from the data files itself
    assert wn.get_version() == "3.0"
    synsets = [s for pos in "nvar" for s in wn.all_synsets(pos)]  # adjective satellites come with "a"
    assert len(synsets) == 117_659
    for synset in random.Random(0).sample(synsets, 400):
        for lemma in synset.lemmas():
            offset, number, tags = index[lemma.key()]
            assert offset == synset.offset() and wn.lemma_from_key(lemma.key()) == lemma
            same_pos = wn.synsets(lemma.name(), "a" if synset.pos() == "s" else synset.pos())
            assert same_pos.index(synset) + 1 == number and lemma.count() == tags
    assert index["dog%1:05:00::"] == (2084071, 1, 42)
    assert index["0%5:00:00:cardinal:00"][1:] == (1, 3)  # a satellite names its head word and lex id (cntlist.rev)


def test_nltks_data_path_finds_the_folder_or_the_downloaded_zip(corpus, tmp_path):
    zipped = tmp_path / "corpora" / "wordnet.zip"  # nltk.download("wordnet")'s layout
    zipped.parent.mkdir()
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("wordnet/", "")  # a folder entry, as the downloaded zip has
        for f in corpus.iterdir():
            z.write(f, f"wordnet/{f.name}")
    code = ("import sys, nltk; nltk.data.path[:] = sys.argv[1:]; from eval.wordnet import require; wn = require(); "
            "print(wn.root, len(wn.synsets('hound')))")  # the data path alone (a folder anywhere wins over a zip)
    for root, where in ((corpus.parents[1], str(corpus)), (tmp_path, "wordnet.zip")):
        done = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, cwd=ROOT,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-800:]
        assert where in done.stdout and done.stdout.split()[-1] == "3"


def test_a_missing_source_is_one_line(tmp_path, capsys):
    assert main(["--source", str(tmp_path / "none"), "--nltk-data", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "wordnet-base" in err and err.count("\n") == 1
    with pytest.raises(OSError):
        install(tmp_path / "none", tmp_path)
