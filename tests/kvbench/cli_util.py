"""Helpers for tests that run the real command line (``python run.py ...``) in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli_env(**extra: str) -> dict[str, str]:
    """Environment of a test subprocess: offline, one thread (deterministic, light on a shared CPU)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBENCH_")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def run_cli(args: list[str], cwd: Path | None = None, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """Run ``python run.py *args`` and return the completed process (text stdout/stderr)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args], cwd=cwd or ROOT, env=cli_env(**env),
        capture_output=True, text=True, timeout=timeout,
    )


# One interpreter imports run.py's modules once (and composes once), then forks a child per command line: each child is its own process
# (state, stderr, exit code) as `python run.py` is, without importing torch and transformers again.
_FORKED = r"""
import json, os, signal, sys, time, traceback
root, tmp, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
sys.path.insert(0, root)
import run, kvbench.job.config
kvbench.job.config.compose([])  # Hydra's plugin scan imports the schemas: methods, tasks, torch
results = []
for i, args in enumerate(json.loads(sys.stdin.read())):
    err = os.path.join(tmp, f"{i}.stderr")
    pid = os.fork()
    if not pid:
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        sys.argv, code = [os.path.join(root, "run.py"), *args], 1
        try:
            code = run.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush(), os._exit(code)
    deadline = time.monotonic() + timeout
    while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    if not done[0]:
        os.kill(pid, signal.SIGKILL), os.waitpid(pid, 0)
    results.append([os.waitstatus_to_exitcode(done[1]) if done[0] else None, open(err).read()])
print(json.dumps(results))
"""


def run_cli_forked(cases: list[list[str]], tmp: Path, timeout: float = 60) -> list[tuple[int | None, str]]:
    """``python run.py *args`` for each of ``cases``: ``(exit code, stderr)``, the code None when the run was stopped
    after ``timeout`` s. One interpreter imports run.py once and forks a child per case (Linux, macOS); what the
    imports print to stderr is the import line of every case's stderr, so noise at import fails its tests too."""
    out = subprocess.run([sys.executable, "-c", _FORKED, str(ROOT), str(tmp), str(timeout)], input=json.dumps(cases),
                         cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=timeout * len(cases) + 60)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return [(code, out.stderr + err) for code, err in json.loads(out.stdout.splitlines()[-1])]


def popen_cli(args: list[str], **env: str) -> subprocess.Popen:
    """Start ``python run.py *args`` without waiting (output discarded)."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, env=cli_env(**env),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def tiny_model_args(model_dir: Path) -> list[str]:
    """Overrides that point the default model node at a tiny local model folder."""
    return [f"model.source={model_dir}", "model.gguf_file=null", "model.name=tiny", "model.max_input_length=1000",
            "model.stop_tokens=[]", "model.chat_template=false"]


def make_haystack_dir(path: Path) -> Path:
    """A folder with two short .txt essays (a few KB: faster to tokenize than the embedded haystack)."""
    path.mkdir(parents=True, exist_ok=True)
    sentences = [f"Essay sentence number {i} talks about gardens, rivers and the price of bread. " for i in range(60)]
    (path / "a.txt").write_text("".join(sentences[:30]))
    (path / "b.txt").write_text("".join(sentences[30:]))
    return path


def compose(args: list[str]):
    """The job config ``python run.py *args`` composes (Hydra's compose API, in this process)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    args = [f"+{a}" if a.startswith("experiment=") else a for a in args]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=args)


def check(args: list[str]):
    """The checked :class:`kvbench.job.config.Job` of ``python run.py *args`` (no model is loaded)."""
    from kvbench.job.config import check as check_cfg

    preset = next((a.split("=", 1)[1] for a in args if a.startswith("method=")), "selkv")
    return check_cfg(compose(args), preset)


def job_dir(args: list[str]) -> Path:
    """The folder that ``python run.py *args`` stores its job in."""
    job = check(args)
    return Path(job.cfg["output_root"]).resolve() / job.relpath


def read_lines(path: Path) -> list[dict]:
    """Every complete line of a ``predictions.jsonl`` as a dict (a truncated tail is left out)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.endswith("\n"):
            out.append(json.loads(line))
    return out


def make_tiny_model_dir(path: Path) -> Path:
    """Save a tiny random Llama model with a byte-level tokenizer (258 tokens) to ``path``.

    Loadable offline by ``AutoTokenizer``/``AutoModelForCausalLM`` like any local model folder;
    the NIAH task cuts its haystack in its tokens (one token per byte).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = byte_tokenizer()
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id, tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + ``<s>``, ``</s>``): every byte is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
