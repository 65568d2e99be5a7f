"""Warm ranks (support/warm_ranks.py): a warm worker ends as the process it stands for would."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.environment import clean_env
from support.processes import fabric_run, run

# appends its pid and attempt to OUT/pids; SIGKILLs itself the first time (OUT/died not there yet), else exits 0
DIE_ONCE = """
import os, signal, sys
out = sys.argv[1]
with open(os.path.join(out, "pids"), "a") as file:
    file.write(f"{os.getpid()} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')}\\n")
if not os.path.exists(os.path.join(out, "died")):
    open(os.path.join(out, "died"), "w").close()
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _skip_unless_warm() -> None:
    if os.environ.get("TEST_WARM_RANKS", "0") == "0":
        pytest.skip("warm ranks are off (TEST_WARM_RANKS=0)")


def _die_once(folder: Path) -> Path:
    _skip_unless_warm()
    script = folder / "die_once.py"
    script.write_text(DIE_ONCE)
    return script


def _runs(folder: Path) -> list[list[str]]:
    return [line.split() for line in (folder / "pids").read_text().splitlines()]


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_warm_worker_that_sigkills_itself_ends_its_stand_in_by_sigkill_and_runs_once(tmp_path: Path) -> None:
    # the stand-in used to raise re-raising SIGKILL (signal.signal refuses it), `site` swallowed that, and the
    # stand-in then ran the program itself, cold: a second run with the same attempt, exit 0 instead of -9
    result = run([sys.executable, str(_die_once(tmp_path)), str(tmp_path)], timeout=40, check=False)
    assert result.returncode == -signal.SIGKILL, result.stderr
    [(pid, _)] = _runs(tmp_path)  # once: by the worker only
    assert f"{pid} {tmp_path / 'die_once.py'}" in Path(os.environ["TEST_WARM_RANKS"] + ".log").read_text()


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_launcher_restarts_a_warm_rank_that_sigkilled_itself(tmp_path: Path) -> None:
    script = _die_once(tmp_path)
    result = run(fabric_run("--max-restarts", 1, script, tmp_path), timeout=40)
    assert "rank 0 was killed by SIGKILL" in result.stderr
    assert [attempt for _, attempt in _runs(tmp_path)] == ["0", "1"]


# calls os.setsid() and prints what became of it: "ok" or the errno
SETSID = """
import os
try:
    os.setsid()
    print("ok")
except OSError as error:
    print(error.errno)
"""


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize("own_session", [False, True], ids=["child", "session-leader"])
def test_a_warm_workers_setsid_answers_as_its_stand_ins_would(tmp_path: Path, own_session: bool) -> None:
    """A fresh child may call setsid() (horovodrun's middlemen do); one that already leads its process group gets
    EPERM. The worker already leads a session of its own, so its call answers for the stand-in."""
    _skip_unless_warm()
    script = tmp_path / "setsid.py"
    script.write_text(SETSID)
    result = subprocess.run([sys.executable, str(script)], env=clean_env(), capture_output=True, text=True, timeout=40,
                            start_new_session=own_session)
    assert result.stdout.split() == ([str(errno.EPERM)] if own_session else ["ok"]), result.stderr
    assert str(script) in Path(os.environ["TEST_WARM_RANKS"] + ".log").read_text()  # it ran warm
