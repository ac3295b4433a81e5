"""Bad input to ``python -m kvbench.latency`` is one line and exit 2, before any model loads."""

from __future__ import annotations

import pytest

from kvbench import latency


@pytest.mark.parametrize("argv, line", [
    (["--methods", "full", "snapkvv"], "--methods snapkvv: unknown method preset; accepted values are adacompresskv"),
    (["modle=smollm2"], "modle=smollm2: Could not override 'modle'."),
    (["--lengths", "512", "-5"], "--lengths -5: must be an integer >= 1"),
    (["--new-tokens", "0"], "--new-tokens 0: must be an integer >= 1"),
    (["--repeats", "0"], "--repeats 0: must be an integer >= 1"),
    # the job runner's validation, per method config, before the model loads
    (["budget=0", "--methods", "full", "snapkv"], "method=full: budget=0: must be > 0"),
    (["budget=abc", "--methods", "snapkv"], "method=snapkv: budget='abc': must be a retention ratio"),
    (["budget=16", "--methods", "full", "snapkv"], "method=snapkv: budget=16: smaller than the 32 tokens"),
    (["budget=0.25", "method.window_size=0"], "method=selkv: method.window_size=0: must be an integer >= 1"),
    (["method.window_size=8", "--methods", "full", "streamingllm"], "method=streamingllm: Could not override "
                                                                   "'method.window_size'."),
])
def test_bad_input_is_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) as exc:
        latency.main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"python -m kvbench.latency: error: {line}")
