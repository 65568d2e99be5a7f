"""The secret of a fault-tolerant job: what every replica group of one job shares and a stranger does not.

A group that comes back copies the model's weights and optimizer state from a live peer over the network. The
peer serves them only to a request that carries the job's secret (``strategies/healing_transport.py``). Every
group of the job must hold the same secret, and the groups are separate ``fabric-torch run`` commands, so:

* :data:`JOB_SECRET_ENV` in the launcher's environment, when the cluster provides one (the same value for every
  group: a scheduler's secret, a Kubernetes Secret, ``python -c "import secrets; print(secrets.token_hex(32))"``);
* otherwise, when the lighthouse is on loopback (every group on this machine, as one user), a secret kept in a
  file that only this user can read, one per lighthouse address, made by the first group that asks;
* otherwise the job is refused: groups on several machines have no such file in common.

The ranks inherit :data:`JOB_SECRET_ENV` from their launcher and read it at set-up (or the file, which they share
with every group on this machine); it is never printed and never part of a URL. Standard library only.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from collections.abc import Mapping

__all__ = ["JOB_SECRET_ENV", "JobSecretError", "job_secret"]

#: The job's secret, as the ranks (and, optionally, the launcher) get it.
JOB_SECRET_ENV = "FABRIC_JOB_SECRET"
_MIN_LENGTH = 16


class JobSecretError(ValueError):
    """No secret for a fault-tolerant job over several machines, or a secret too short to be one."""


def job_secret(lighthouse_url: str, on_loopback: bool, env: Mapping[str, str] | None = None) -> str:
    """The job's secret: from :data:`JOB_SECRET_ENV`, else (``on_loopback``) from this user's file for the lighthouse."""
    env = os.environ if env is None else env
    given = env.get(JOB_SECRET_ENV, "")
    if given:
        if len(given) < _MIN_LENGTH:
            raise JobSecretError(
                f"{JOB_SECRET_ENV} holds {len(given)} character(s); accepted: at least {_MIN_LENGTH} (for example the"
                " output of `python -c \"import secrets; print(secrets.token_hex(32))\"`)"
            )
        return given
    if not on_loopback:
        raise JobSecretError(
            f"the lighthouse at {lighthouse_url} is on another machine, so the replica groups of this job run on several"
            f" machines and need a secret they share: set {JOB_SECRET_ENV} to the same value in the environment of every"
            " group's `fabric-torch run` (for example `python -c \"import secrets; print(secrets.token_hex(32))\"`);"
            " a group's peers serve its weights only to a request that carries it"
        )
    return _shared_file_secret(lighthouse_url)


def _shared_file_secret(lighthouse_url: str) -> str:
    """This user's secret for the lighthouse at ``lighthouse_url``: read, or made once (atomically) and read."""
    folder = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(), f"fabric-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise JobSecretError(
            f"{folder} is not a folder that only this user can use (owner uid {info.st_uid}, mode"
            f" {stat.filemode(info.st_mode)}); remove it, or set {JOB_SECRET_ENV}"
        )
    name = "".join(char if char.isalnum() else "_" for char in lighthouse_url.split("://", 1)[-1])
    path = os.path.join(folder, f"ft-secret-{name}")
    if not os.path.exists(path):
        fd, temporary = tempfile.mkstemp(dir=folder, prefix=".ft-secret-")
        try:
            with os.fdopen(fd, "w") as file:
                file.write(secrets.token_hex(32))
            try:
                os.link(temporary, path)  # fails if another group made it first: theirs is the job's
            except FileExistsError:
                pass
        finally:
            os.unlink(temporary)
    with open(path) as file:
        return file.read().strip()
