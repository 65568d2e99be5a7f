"""What a killed sharded save leaves beside the checkpoint (``.fabric-tmpdir-*``, ``.fabric-old-*``) is removed
by the next load once its writer is gone (same host, pid no longer alive); every other folder is left."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.checkpoint.formats.sharded import save_sharded
from fabric.checkpoint.storage import disk as publish
from support.environment import clean_env
from support.processes import alive

pytestmark = [pytest.mark.procs, pytest.mark.cold]

if not sys.platform.startswith("linux"):
    pytest.skip("a real SIGKILL of a writer process", allow_module_level=True)

_WRITER = textwrap.dedent("""\
    import sys, torch
    from torch import nn
    from fabric.checkpoint.formats.sharded import save_sharded
    torch.set_num_threads(1)
    model = nn.Linear(512, 512)
    step = 0
    while True:
        with torch.no_grad():
            model.weight.fill_(step)
            model.bias.fill_(step)
        save_sharded(sys.argv[1], {"model": model, "step": step})
        step += 1
""")


def _kill_mid_save(folder: Path, attempts: int = 20) -> Path:
    """Start a writer saving ``folder`` in a loop; SIGKILL it while its temporary folder exists."""
    for _ in range(attempts):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(folder)], env=clean_env(OMP_NUM_THREADS="1"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                temps = [t for t in folder.parent.glob(f"{publish.TEMP_FOLDER_PREFIX}{folder.name}.*")
                         if (t / publish.WRITER_FILE).exists()]
                if temps and folder.exists():
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
                    left = [t for t in temps if t.exists()]
                    if left:
                        return left[0]
                    break
                time.sleep(0.002)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    pytest.fail(f"no save was killed mid-write in {attempts} attempts")


@pytest.mark.timeout(180)
def test_a_load_removes_the_folder_a_killed_save_left(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    stale = _kill_mid_save(folder)
    writer_pid = int((stale / publish.WRITER_FILE).read_text().split()[1])
    assert not alive(writer_pid)
    model = nn.Linear(512, 512)
    rest = Fabric(accelerator="cpu", devices=1).load(folder, {"model": model})
    assert not stale.exists()
    # the checkpoint it loaded is one save's, whole
    assert torch.all(model.weight == rest["step"]) and torch.all(model.bias == rest["step"])


def test_folders_of_live_writers_other_hosts_and_unknown_writers_are_left(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_sharded(folder, {"model": nn.Linear(4, 4)})
    dead = subprocess.Popen(["true"])
    dead.wait()
    records = {
        "aaaaaaaaaaaa": f"{socket.gethostname()} {os.getpid()}",  # alive: a save in progress
        "bbbbbbbbbbbb": f"another-host-{socket.gethostname()} {dead.pid}",  # another machine's
        "cccccccccccc": None,  # no record
        "dddddddddddd": f"{socket.gethostname()} {dead.pid}",  # gone: removed
    }
    for token, record in records.items():
        temp = publish.temp_folder_for(folder, token)
        temp.mkdir()
        if record is not None:
            (temp / publish.WRITER_FILE).write_text(record)
    aside = tmp_path / f"{publish.ASIDE_PREFIX}ckpt.eeeeeeeeeeee"
    aside.mkdir()
    (aside / publish.WRITER_FILE).write_text(f"{socket.gethostname()} {dead.pid}")  # gone, ckpt exists: removed
    Fabric(accelerator="cpu", devices=1).load(folder, {"model": nn.Linear(4, 4)})
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["ckpt", *(f"{publish.TEMP_FOLDER_PREFIX}ckpt.{t}" for t in "abc" for t in [t * 12])])


def test_an_aside_copy_that_is_the_previous_checkpoint_is_kept(tmp_path: Path) -> None:
    """A commit cut between its renames: ``ckpt`` is missing and the aside copy is the checkpoint."""
    folder = tmp_path / "ckpt"
    save_sharded(folder, {"model": nn.Linear(4, 4)})
    dead = subprocess.Popen(["true"])
    dead.wait()
    aside = tmp_path / f"{publish.ASIDE_PREFIX}ckpt.eeeeeeeeeeee"
    folder.rename(aside)
    (aside / publish.WRITER_FILE).write_text(f"{socket.gethostname()} {dead.pid}")
    Fabric(accelerator="cpu", devices=1).load(folder, {"model": nn.Linear(4, 4)})
    assert aside.is_dir()


def _dead_pid() -> int:
    dead = subprocess.Popen(["true"])
    dead.wait()
    return dead.pid


def _leftovers_of_other_checkpoints(tmp_path: Path) -> dict[str, bool]:
    """Leftover folders of checkpoints named by step (a killed job's); whether each should go."""
    host, gone = socket.gethostname(), _dead_pid()
    save_sharded(tmp_path / "step-1", {"model": nn.Linear(4, 4)})
    leftovers = {
        f"{publish.TEMP_FOLDER_PREFIX}step-2.aaaaaaaaaaaa": f"{host} {gone}",  # killed mid-write: goes
        f"{publish.TEMP_FOLDER_PREFIX}step-2.v1.bbbbbbbbbbbb": f"{host} {os.getpid()}",  # a save in progress: stays
        f"{publish.ASIDE_PREFIX}step-1.cccccccccccc": f"{host} {gone}",  # step-1 exists: goes
        f"{publish.ASIDE_PREFIX}step-0.dddddddddddd": f"{host} {gone}",  # step-0 missing: it is step-0, stays
        f"{publish.TEMP_FOLDER_PREFIX}step-3.eeeeeeeeeeee": f"other-{host} {gone}",  # another machine's: stays
    }
    for name, record in leftovers.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / publish.WRITER_FILE).write_text(record)
    return {name: record.startswith(host) and record.endswith(f" {gone}") and "step-0" not in name
            for name, record in leftovers.items()}


def test_a_load_removes_what_killed_saves_of_other_checkpoints_left_in_its_folder(tmp_path: Path) -> None:
    goes = _leftovers_of_other_checkpoints(tmp_path)
    save_sharded(tmp_path / "step-9", {"model": nn.Linear(4, 4)})
    Fabric(accelerator="cpu", devices=1).load(tmp_path / "step-9", {"model": nn.Linear(4, 4)})
    for name, removed in goes.items():
        assert (tmp_path / name).exists() is not removed, name
    assert (tmp_path / "step-1").is_dir()


def test_the_first_save_of_a_job_in_a_folder_removes_what_killed_saves_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that names checkpoints by step never saves or loads the killed one's name again."""
    monkeypatch.setattr(publish, "_swept", set())  # a new process
    goes = _leftovers_of_other_checkpoints(tmp_path)
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.save(tmp_path / "step-10.pt", {"step": 10})
    for name, removed in goes.items():
        assert (tmp_path / name).exists() is not removed, name
    # only once per process and folder: a later leftover waits for the next job (or a load)
    late = tmp_path / f"{publish.TEMP_FOLDER_PREFIX}step-4.ffffffffffff"
    late.mkdir()
    (late / publish.WRITER_FILE).write_text(f"{socket.gethostname()} {_dead_pid()}")
    fabric.save(tmp_path / "step-11.pt", {"step": 11})
    assert late.is_dir()


@pytest.mark.timeout(180)
def test_a_new_job_saving_under_another_name_removes_a_killed_saves_folder(tmp_path: Path) -> None:
    """Real processes: a writer SIGKILLed mid-save of ``ckpt``; a new job that only saves ``other.pt`` there."""
    stale = _kill_mid_save(tmp_path / "ckpt")
    job = "import sys; from fabric import Fabric; Fabric(accelerator='cpu', devices=1).save(sys.argv[1], {'step': 1})"
    subprocess.run([sys.executable, "-c", job, str(tmp_path / "other.pt")], env=clean_env(OMP_NUM_THREADS="1"),
                   check=True, timeout=120)
    assert not stale.exists()
    assert (tmp_path / "other.pt").is_file()


_KILLED_AT = textwrap.dedent("""\
    import os, signal, sys
    import torch
    from torch import nn
    from fabric.checkpoint.formats.sharded import save_sharded
    from fabric.checkpoint.storage import disk

    folder, moment = sys.argv[1], sys.argv[2]
    rename = os.rename

    def rename_then_maybe_die(src, dst):
        name = os.path.basename(str(src))
        if moment == "commit" and name.startswith(disk.TEMP_FOLDER_PREFIX) and str(dst) == folder:
            os.kill(os.getpid(), signal.SIGKILL)  # the save's files are written: killed as it publishes them
        rename(src, dst)
        if moment == "spare" and name.startswith(disk.SPARE_PREFIX):
            os.kill(os.getpid(), signal.SIGKILL)  # the previous save's folder has just become this one's temporary

    os.rename = rename_then_maybe_die
    for step in range(3):
        save_sharded(folder, {"model": nn.Linear(8, 8), "step": step})
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("moment", ["commit", "spare"])
def test_a_save_killed_as_it_commits_or_takes_up_its_spare_folder_leaves_a_folder_the_next_job_removes(
    tmp_path: Path, moment: str
) -> None:
    """The two moments at which a sharded save's temporary folder used to hold no writer record (before: the
    record was removed before the folder was renamed into place, and added only after the spare folder of the
    previous save was renamed to be the temporary one): a kill there left the folder for good."""
    folder = tmp_path / "ckpt"
    killed = subprocess.run([sys.executable, "-c", _KILLED_AT, str(folder), moment], env=clean_env(OMP_NUM_THREADS="1"),
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    [temp] = tmp_path.glob(f"{publish.TEMP_FOLDER_PREFIX}ckpt.*")
    job = "import sys; from fabric import Fabric; Fabric(accelerator='cpu', devices=1).save(sys.argv[1], {'step': 1})"
    subprocess.run([sys.executable, "-c", job, str(tmp_path / "other.pt")], env=clean_env(OMP_NUM_THREADS="1"),
                   check=True, timeout=120)
    assert not temp.exists()
    if moment == "spare":  # the second save is the checkpoint, whole (its commit made the first one the spare)
        assert Fabric(accelerator="cpu", devices=1).load(folder, {"model": nn.Linear(8, 8)})["step"] == 1
    else:
        assert not folder.exists()
