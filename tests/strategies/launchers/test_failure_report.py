"""A failure is reported once: the cause first, the user's own frame, a few of the library's, for every rank at once.

Real 2-rank CPU jobs (``support/scripts/launchers/failing_job.py``) under ``fabric-torch run`` and under
``fabric.launch()`` (popen): Ctrl-C is one line; a checkpoint that fits no rank's model is one report naming both
ranks and every misfit; ``FABRIC_FULL_TRACEBACKS=1`` brings back each rank's whole traceback. The pieces
(``fabric/supervision/failure_report.py``) are checked in this process.
"""

from __future__ import annotations

import pickle
import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from fabric import Fabric
from fabric.supervision.failure_report import FULL_TRACEBACKS_ENV, brief_traceback, failure_report
from fabric.supervision.supervisor import RankFailedError
from support import PYTHON
from support.environment import job_environment
from support.loading import script_path
from support.processes import fabric_run, finish, read_ranks, run, start, wait_dead, wait_for_files

if not sys.platform.startswith("linux"):
    pytest.skip("the supervisor uses pidfds", allow_module_level=True)

JOB = script_path("launchers", "failing_job.py")
#: every tensor of the job's model (Linear(4, 8), ReLU, Linear(8, 2)) loaded into one of hidden size 3
MISFITS = [("0.weight", (8, 4), (3, 4)), ("0.bias", (8,), (3,)), ("2.weight", (2, 8), (2, 3))]


def _command(launcher: str, folder: Path, how: str) -> list[str]:
    if launcher == "fabric run":
        return fabric_run("--devices", "2", JOB, folder, how)
    return [PYTHON, str(JOB), str(folder), how, "--processes", "2", *(["--spawn"] if launcher == "spawn" else [])]


def _reports(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[fabric]")]


# ---- real jobs -------------------------------------------------------------------------------------------


@pytest.mark.procs
@pytest.mark.cold  # its subject is a signal to the launching process
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["fabric run", "popen", "spawn"])
def test_ctrl_c_on_a_two_rank_job_is_one_line(tmp_path: Path, launcher: str) -> None:
    proc = start(_command(launcher, tmp_path, "wait"), env=job_environment())
    try:
        wait_for_files(tmp_path, "rank*.json", 2, timeout=90)
    finally:
        proc.send_signal(signal.SIGINT)
        [(code, _, err)] = finish([proc], 30)
    # spawn: the KeyboardInterrupt leaves launch() as in any Python program, which then ends by SIGINT
    assert code == (-signal.SIGINT if launcher == "spawn" else 128 + signal.SIGINT), err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and re.search(r"^\[fabric\] (rank 0 )?received SIGINT; stop", lines[0]), err
    wait_dead([record["pid"] for record in read_ranks(tmp_path).values()], timeout=5)


@pytest.mark.procs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["fabric run", "popen"])
def test_a_checkpoint_that_fits_no_rank_is_one_report_naming_both_ranks_and_every_misfit(tmp_path: Path, launcher: str) -> None:
    result = run(_command(launcher, tmp_path, "mismatch"), timeout=110, env=job_environment(), check=False)
    err = result.stderr
    assert result.returncode == 1, err
    reports = _reports(err)
    assert len(reports) == 1 and re.match(r"\[fabric\] rank 0, 1 raised CheckpointMismatchError, pid \d+, \d+$", reports[0]), err
    assert err.count("CheckpointMismatchError: state['model']: The checkpoint does not fit Sequential") == 1, err
    for name, saved, current in MISFITS:  # every key, with both shapes, once
        assert err.count(f"{name!r} has shape {saved} in the checkpoint but {current} in the model") == 1, err
    # the user's own frame, then at most a few of the library's, and where the whole tracebacks are
    assert 'failing_job.py", line' in err and "fabric.load(out" in err
    library = re.findall(r'^  File "\S*/fabric/(?!.*tests/)\S*", line', err, re.MULTILINE)
    assert len(library) == 2, err  # the call the user made (fabric.load) and where it raised
    assert re.search(r"^  \.\.\. \d+ frames inside fabric", err, re.MULTILINE), err
    assert f"{FULL_TRACEBACKS_ENV}=1" in err
    assert "Traceback (most recent call last)" not in err and "[rank0]" not in err and "[rank 0]" not in err
    # nothing else: the report is the whole of stderr
    assert err.startswith(reports[0]) and err.rstrip().endswith(f"({FULL_TRACEBACKS_ENV}=1 prints every rank's full traceback)")


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_under_spawn_the_launchers_error_is_the_one_report(tmp_path: Path) -> None:
    result = run(_command("spawn", tmp_path, "mismatch"), timeout=110, env=job_environment(), check=False)
    err = result.stderr
    assert result.returncode == 1, err
    assert err.count("RankFailedError: rank 0, 1 raised CheckpointMismatchError\n") == 1, err
    for name, saved, current in MISFITS:
        assert err.count(f"{name!r} has shape {saved} in the checkpoint but {current} in the model") == 1, err
    assert 'failing_job.py", line' in err and "in job" in err and "[rank" not in err
    assert err.count("Traceback (most recent call last)") == 1  # the launching process's own, as Python prints it


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_full_tracebacks_on_request_each_rank_prints_its_own_in_one_label_form(tmp_path: Path) -> None:
    env = job_environment(**{FULL_TRACEBACKS_ENV: "1"})
    result = run(_command("fabric run", tmp_path, "mismatch"), timeout=110, env=env, check=False)
    err = result.stderr
    assert result.returncode == 1, err
    for rank in (0, 1):
        own = [line for line in err.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert own[0] == f"[rank {rank}] Traceback (most recent call last):", err
        assert any("fabric/checkpoint/fit.py" in line for line in own), err  # every library frame is there
        error = f"[rank {rank}] fabric.checkpoint.errors.CheckpointMismatchError: state['model']: "
        assert any(line.startswith(error) for line in own), err
    assert not re.search(r"\[rank\d", err), err  # torch's "[rank0]:" form is not used
    assert err.count("Traceback (most recent call last)") == 2
    reports = _reports(err)
    assert len(reports) == 1 and reports[0].startswith("[fabric] rank 0, 1 raised CheckpointMismatchError (traceback above), pid "), err


# ---- the pieces, in this process ----------------------------------------------------------------------------


def _misfit(tmp_path: Path) -> BaseException:
    """The error of loading a checkpoint into a model of another shape, raised through every layer of fabric."""
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.save(tmp_path / "model.pt", {"model": torch.nn.Linear(4, 8)})
    with pytest.raises(RuntimeError) as info:
        fabric.load(tmp_path / "model.pt", {"model": torch.nn.Linear(4, 3)})
    return info.value


def test_a_brief_traceback_keeps_the_users_frame_and_the_first_and_last_of_the_librarys(tmp_path: Path) -> None:
    brief = brief_traceback(_misfit(tmp_path)).splitlines()
    assert brief[0].startswith("fabric.checkpoint.errors.CheckpointMismatchError: state['model']: ")
    frames = [line for line in brief if line.startswith('  File "')]
    assert "test_failure_report.py" in frames[0] and "in _misfit" in frames[0]  # the user's own frame first
    assert brief[brief.index(frames[0]) + 1].strip().startswith("fabric.load(")  # with its line
    assert len(frames) == 3 and "fabric/fabric.py" in frames[1] and "fabric/checkpoint/fit.py" in frames[2]
    [hidden] = [line for line in brief if line.startswith("  ... ")]
    assert re.fullmatch(r"  \.\.\. \d+ frames inside fabric", hidden)


def test_a_brief_traceback_names_the_exceptions_it_came_from() -> None:
    try:
        try:
            {}["step"]
        except KeyError as err:
            raise ValueError("no step in the checkpoint") from err
    except ValueError as err:
        brief = brief_traceback(err)
    assert brief.splitlines()[0] == "ValueError: no step in the checkpoint"
    assert brief.splitlines()[-1] == "  (caused by KeyError: 'step')"


def test_the_report_names_every_rank_that_met_the_same_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FULL_TRACEBACKS_ENV, raising=False)
    same, other = "ValueError: boom\n  File \"train.py\", line 3, in <module>", "RuntimeError: connection closed by peer"
    briefs = {0: same, 1: other, 2: same}
    report = failure_report(2, True, "rank 2 raised an exception", briefs, {0: 10, 1: 11, 2: 12}, running={0, 1, 2, 3})
    headline, *body = report.splitlines()
    assert headline == "rank 0, 2 raised ValueError, pid 10, 12; stopping the other 2 rank(s) on this node"
    assert body == [*same.splitlines(), f"({FULL_TRACEBACKS_ENV}=1 prints every rank's full traceback)"]
    # a rank that died is the cause alone, in one line; so is a job whose ranks all met it (nothing else to stop)
    assert failure_report(1, False, "rank 1 was killed by SIGKILL", briefs, {1: 11}, running={0}) == (
        "rank 1 was killed by SIGKILL, pid 11; stopping the other 1 rank(s) on this node"
    )
    assert failure_report(0, True, "", {0: same, 1: same}, None, running={0, 1}).splitlines()[0] == "rank 0, 1 raised ValueError"
    monkeypatch.setenv(FULL_TRACEBACKS_ENV, "1")  # the ranks printed their own: the report names the cause
    assert failure_report(2, True, "", briefs, None, running=()) == "rank 0, 2 raised ValueError (traceback above)"
    # a worker's whole traceback travels in the report (the multiprocessing launcher's ranks print nothing)
    assert failure_report(2, True, "", briefs, None, running=(), full_traceback="[rank 2] Traceback ...\n") == (
        "rank 0, 2 raised ValueError\n[rank 2] Traceback ..."
    )


def test_a_rank_failed_error_carries_the_report_across_processes() -> None:
    err = RankFailedError(1, 1, "[rank 1] Traceback ...", report="rank 0, 1 raised ValueError\nValueError: boom")
    assert str(err) == "rank 0, 1 raised ValueError\nValueError: boom"
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == str(err) and copy.traceback_text == err.traceback_text and copy.report == err.report
