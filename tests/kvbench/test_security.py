"""Security: no eval/exec/pickle of data, trust_remote_code off by default, config paths checked."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest
import yaml

from kvbench.job.config import TopConfig, structured
from methods.base import ConfigError
from tests.kvbench.cli_util import ROOT

PACKAGES = ("kvbench", "methods", "eval", "benchmarks")


def source_files() -> list[Path]:
    files = [ROOT / "run.py"]
    for pkg in PACKAGES:
        files += sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []
    return files


def code_tokens(path: Path) -> list[str]:
    """The names and operators of a Python file: comments and strings (docstrings) left out."""
    keep = (tokenize.NAME, tokenize.OP)
    toks = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return [t.string for t in toks if t.type in keep]


def findings(tokens: list[str]) -> list[str]:
    found = []
    for i, tok in enumerate(tokens):
        prev = tokens[i - 1] if i else ""
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        after = tokens[i + 2] if i + 2 < len(tokens) else ""
        if tok in ("eval", "exec", "compile", "__import__") and nxt == "(" and prev not in (".", "def"):
            found.append(f"{tok}()")
        if tok in ("pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve") and prev in ("import", "from", ","):
            found.append(f"import {tok}")
        if prev == "." and tok == "load" and nxt == "(" and i >= 2 and tokens[i - 2] in ("torch", "pickle", "yaml", "np", "numpy"):
            found.append(f"{tokens[i - 2]}.load()")
        if tok in ("unsafe_load", "full_load", "UnsafeLoader", "FullLoader"):
            found.append(tok)
        if tok == "shell" and nxt == "=" and after == "True":
            found.append("shell=True")
        if tok == "trust_remote_code" and nxt == "=" and after == "True":
            found.append("trust_remote_code=True")
        if prev == "." and tok == "system" and i >= 2 and tokens[i - 2] == "os":
            found.append("os.system()")
    return found


def test_the_scanner_finds_what_it_looks_for(tmp_path):
    p = tmp_path / "probe.py"
    p.write_text(
        "import pickle\nx = eval(s)\ny = torch.load(p)\nz = yaml.load(f)\nrun(c, shell=True)\n"
        '"""eval(x) in a docstring is fine"""\n# exec(y) in a comment too\nm.eval()\n'
    )
    assert findings(code_tokens(p)) == ["import pickle", "eval()", "torch.load()", "yaml.load()", "shell=True"]


@pytest.mark.parametrize("path", source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_code_execution_or_unsafe_deserialisation(path):
    assert findings(code_tokens(path)) == []


def test_trust_remote_code_is_off_in_every_model_config():
    for path in sorted((ROOT / "conf" / "model").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        assert data.get("trust_remote_code", False) is False, path.name


def test_load_model_passes_trust_remote_code_false_by_default(tiny_model_dir, monkeypatch):
    import transformers

    from kvbench.engine.models import load_model

    seen = []
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        original = cls.from_pretrained.__func__

        def spy(klass, *args, _original=original, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    loaded = load_model({"name": "tiny", "source": str(tiny_model_dir), "gguf_file": None, "stop_tokens": [],
                         "chat_template": "none"}, "cpu")
    assert seen == [False, False]
    assert loaded.layout.num_layers == 2


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/abs/path"])
def test_run_name_cannot_leave_output_root(name):
    with pytest.raises(ConfigError, match="run_name"):
        structured(TopConfig, {"run_name": name})
