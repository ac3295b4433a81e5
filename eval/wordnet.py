"""WordNet 3.0 for NLTK from Debian's ``wordnet-base`` (``/usr/share/wordnet``), offline: LooGLE's METEOR needs it.

NLTK's WordNet reader (3.10) reads the Princeton database files and two more that the package lacks, both written
here from its data: ``lexnames`` (WordNet 3.0's 45 lexicographer files) and ``index.sense`` (a line per sense,
``sense_key synset_offset sense_number tag_cnt``, sorted: the sense key from the data files as WordNet's senseidx(5WN)
defines it, the sense number from the order of the synsets in ``index.<pos>``, the tag count from ``cntlist.rev``, 0
when absent). The files are copied (NLTK refuses links that leave its data folder) to
``<nltk_data>/corpora/wordnet``::

    python -m eval.wordnet [--source /usr/share/wordnet] [--nltk-data DIR]   # default: $NLTK_DATA, else <venv>/nltk_data

``.ci/wordnet_setup.sh`` installs the package and runs this. Online, ``nltk.download("wordnet")`` gives the same
corpus; NLTK finds either on its data path (:func:`require`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from .base import TaskConfigError

POS = ("noun", "verb", "adj", "adv")
SS_TYPE = {"n": 1, "v": 2, "a": 3, "r": 4, "s": 5}
#: WordNet 3.0's lexicographer files, numbered as lex_filenum (lexnames(5WN)): name and part of speech
LEXNAMES = [("adj.all", 3), ("adj.pert", 3), ("adv.all", 4)] + [(f"noun.{n}", 1) for n in (
    "Tops act animal artifact attribute body cognition communication event feeling food group location motive object "
    "person phenomenon plant possession process quantity relation shape state substance time").split()] + [
    (f"verb.{n}", 2) for n in ("body change cognition communication competition consumption contact creation emotion "
                               "motion perception possession social stative weather").split()] + [("adj.ppl", 3)]
INSTALL = ("LooGLE's METEOR needs NLTK's WordNet: run `bash .ci/wordnet_setup.sh` (Debian's wordnet-base, as root) or, "
           "online, python -c \"import nltk; nltk.download('wordnet')\"")


def require():
    """NLTK's WordNet reader, loaded. TaskConfigError: WordNet is not on NLTK's data path (:data:`INSTALL`)."""
    from nltk.corpus import wordnet

    try:
        wordnet.ensure_loaded()
    except LookupError:
        raise TaskConfigError(INSTALL) from None
    return wordnet


def senses(source: Path) -> list[str]:
    """The ``index.sense`` lines of the database in ``source``, sorted (NLTK binary-searches the file)."""
    synsets: dict[tuple[str, int], tuple[str, int, list[tuple[str, int]], int | None]] = {}
    for pos in POS:  # offset -> (ss_type, lex_filenum, [(lemma, lex_id)], head synset offset of a satellite)
        for line in (source / f"data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  "):
                continue
            f = line.split()
            n = int(f[3], 16)
            words = [(f[4 + 2 * i].lower().split("(")[0], int(f[5 + 2 * i], 16)) for i in range(n)]
            at = 4 + 2 * n
            pointers = [f[at + 1 + 4 * i: at + 5 + 4 * i] for i in range(int(f[at]))]
            head = next((int(p[1]) for p in pointers if p[0] == "&"), None) if f[2] == "s" else None
            synsets[(pos, int(f[0]))] = (f[2], int(f[1]), words, head)
    number = {}  # (lemma, pos, offset) -> sense number: the order of the offsets in index.<pos>
    for pos in POS:
        for line in (source / f"index.{pos}").read_text(encoding="latin-1").splitlines():
            if not line.startswith("  "):
                f = line.split()
                offsets = f[-int(f[2]):]
                number.update({(f[0], pos, int(o)): k for k, o in enumerate(offsets, 1)})
    tags = {}
    for line in (source / "cntlist.rev").read_text(encoding="latin-1").splitlines():
        key, _, count = line.split()
        tags[key] = int(count)
    lines = []
    for (pos, offset), (ss_type, lexfile, words, head) in synsets.items():
        head_word, head_id = ("", "") if head is None else synsets[("adj", head)][2][0]
        for lemma, lex_id in words:
            key = f"{lemma}%{SS_TYPE[ss_type]}:{lexfile:02d}:{lex_id:02d}:{head_word}:" + (
                "" if head is None else f"{head_id:02d}")
            lines.append(f"{key} {offset:08d} {number[(lemma, pos, offset)]} {tags.get(key, 0)}\n")
    return sorted(set(lines))  # a word listed twice in a synset (a, A) is one sense


def install(source: Path, nltk_data: Path) -> Path:
    """Copy the database in ``source`` to ``<nltk_data>/corpora/wordnet`` with ``lexnames`` and ``index.sense``;
    returns that folder. OSError: a file cannot be read or written."""
    target = nltk_data / "corpora" / "wordnet"
    target.mkdir(parents=True, exist_ok=True)
    for name in [f"{kind}.{pos}" for kind in ("data", "index") for pos in POS] + [f"{p}.exc" for p in POS] + ["cntlist.rev"]:
        shutil.copyfile(source / name, target / name)
    (target / "lexnames").write_text("".join(f"{i:02d}\t{name}\t{pos}\n" for i, (name, pos) in enumerate(LEXNAMES)))
    (target / "index.sense").write_text("".join(senses(source)))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Install WordNet 3.0 (Debian's wordnet-base) as NLTK's corpus.")
    parser.add_argument("--source", type=Path, default=Path("/usr/share/wordnet"), help="the package's folder")
    parser.add_argument("--nltk-data", type=Path, default=Path(os.environ.get("NLTK_DATA", "").split(os.pathsep)[0] or Path(sys.prefix, "nltk_data")),
                        help="an NLTK data folder (default: $NLTK_DATA, else <python prefix>/nltk_data)")
    args = parser.parse_args(argv)
    try:
        print(f"WordNet installed in {install(args.source, args.nltk_data)}")
    except OSError as e:
        print(f"error: {e.filename}: {e.strerror} (apt-get install wordnet-base, or --source)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
