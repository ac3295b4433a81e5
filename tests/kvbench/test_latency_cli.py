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
])
def test_bad_input_is_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) as exc:
        latency.main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"python -m kvbench.latency: error: {line}")
