#!/usr/bin/env bash
# WordNet 3.0 for LooGLE's METEOR, offline: Debian's wordnet-base (/usr/share/wordnet, as root) made into NLTK's
# corpus in the active Python's <prefix>/nltk_data (or $NLTK_DATA) by `python -m eval.wordnet` (eval/wordnet.py).
# Run it inside the virtual environment, after `pip install -e .`. Idempotent; never fails the run: without apt-get
# or root it says why and exits 0, and the METEOR tests skip (online, nltk.download("wordnet") serves as well).
#
# Usage: bash .ci/wordnet_setup.sh
set -uo pipefail
cd "$(dirname "$0")/.."

if [ ! -f /usr/share/wordnet/data.noun ]; then
    if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
        echo "wordnet_setup: no apt-get or not root, cannot install wordnet-base; METEOR tests will skip" >&2
        exit 0
    fi
    log=$(mktemp)
    if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wordnet-base; } \
            >"$log" 2>&1; then
        echo "wordnet_setup: apt-get failed (METEOR tests will skip); last lines:" >&2
        tail -n 20 "$log" >&2
        exit 0
    fi
fi
python -m eval.wordnet || echo "wordnet_setup: python -m eval.wordnet failed; METEOR tests will skip" >&2
