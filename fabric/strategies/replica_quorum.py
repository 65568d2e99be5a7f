"""Each quorum torchft's lighthouse hands a replica group, checked and made safe before torchft acts on it.

The ``Manager`` asks for a quorum through a client of its group's manager server; :class:`QuorumClient` stands in
for that client and forwards every call, and for each quorum that comes back:

* **refuses a job set up wrong**, in seconds and naming the values, before the process group across groups is
  built (where a mistake would only show as gloo timeouts, or as two groups silently reading the same data): groups
  with different numbers of ranks, two groups with the same ``--replica-group``, different ``--num-replica-groups``
  or strategies, and a group restarted after its peers finished (or lost their state), which would train alone
  from step 0. Every group tells the others its set-up through its replica id (:func:`replica_id`), which the
  lighthouse passes to every member of a quorum;
* **gives the process group across groups a store prefix of its own quorum**: torchft names it after the quorum's
  number, which starts again at 1 when the lighthouse is restarted, so the prefix of an earlier quorum (and the
  keys its process group left in the store) could be met again; the prefix here also names the quorum's members
  and step;
* **says what a quorum that never came means**: torchft raises a bare ``TimeoutError``; here the error names the
  lighthouse, whether it answers at all, the bound (``quorum_timeout``), and what to do.

The manager server (rank 0 of the group) asks the lighthouse again, about once a second, while a request fails
(``quorum_retries``), so a lighthouse that is restarted on the same address within ``quorum_timeout`` costs no
group, even when it died with a request under way.
"""

from __future__ import annotations

import hashlib
import re
import socket
from datetime import timedelta
from typing import Any

from fabric._core.listening import lighthouse_address

__all__ = ["LighthouseLostError", "QuorumClient", "ReplicaSetupError", "quorum_retries", "replica_id"]

_ID = re.compile(r"^fabric-(?P<strategy>[a-z_]+)-(?P<groups>\d+)groups-(?P<ranks>\d+)ranks-group(?P<group>\d+)$")


class ReplicaSetupError(RuntimeError):
    """The replica groups of a job do not fit together (sizes, numbers, strategies), or a group would start over alone."""


class LighthouseLostError(RuntimeError):
    """No quorum came from the lighthouse within ``quorum_timeout``."""


def replica_id(strategy: str, groups: int, ranks: int, group: int) -> str:
    """A group's replica id: its set-up, which every member of a quorum sees, with its number last (torchft reads the
    group's number from the id's trailing digits)."""
    return f"fabric-{strategy}-{groups}groups-{ranks}ranks-group{group}"


def quorum_retries(quorum_timeout: timedelta) -> int:
    """How often the manager server asks the lighthouse again while a request fails: torchft waits
    ``quorum_timeout / (retries + 1)`` between tries, so one try a second over the whole bound."""
    return max(1, int(quorum_timeout.total_seconds()))


class QuorumClient:
    """Stands in for the ``Manager``'s client of its manager server; see the module's docstring.

    Args:
        client: torchft's ``ManagerClient``.
        strategy, groups, ranks, group: this group's set-up (as in its :func:`replica_id`).
        lighthouse: the lighthouse's address (``http://HOST:PORT``).
        quorum_timeout: the bound on one quorum.
        steps_before: the highest step this group committed in an earlier attempt (0: none, or not known).
    """

    def __init__(
        self, client: Any, *, strategy: str, groups: int, ranks: int, group: int, lighthouse: str, quorum_timeout: timedelta,
        steps_before: int,
    ) -> None:
        self._client = client
        self._groups = groups
        self._group = group
        self._lighthouse = lighthouse
        self._quorum_timeout = quorum_timeout
        self._steps_before = steps_before
        self._first = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, **kwargs: Any) -> Any:
        try:
            quorum = self._client._quorum(**kwargs)
        except TimeoutError:
            raise LighthouseLostError(self._no_quorum()) from None
        members = [_member(name) for name in quorum.replica_ids]
        self._check(members, int(quorum.max_step))
        self._first = False
        token = hashlib.sha256(f"{quorum.quorum_id}|{quorum.max_step}|{'|'.join(sorted(quorum.replica_ids))}".encode())
        quorum.store_address = f"{quorum.store_address}/fabric/{token.hexdigest()[:16]}"
        return quorum

    def _check(self, members: list[dict[str, Any]], max_step: int) -> None:
        def listing(key: str) -> str:
            return ", ".join(f"group {member['group']}: {member[key]}" for member in sorted(members, key=lambda m: m["group"]))

        for key, what, flag in (
            ("strategy", "strategies", "strategy"),
            ("groups", "numbers of replica groups", "--num-replica-groups"),
            ("ranks", "numbers of ranks", "--devices x --num-nodes"),
        ):
            if len({member[key] for member in members}) > 1:
                raise ReplicaSetupError(
                    f"the replica groups in the quorum have different {what} ({listing(key)}); every group of a"
                    f" fault-tolerant job needs the same {flag}"
                )
        numbers = [member["group"] for member in members]
        twice = sorted({number for number in numbers if numbers.count(number) > 1})
        if twice:
            raise ReplicaSetupError(
                f"{numbers.count(twice[0])} replica groups of this job run as --replica-group {twice[0]} (the quorum:"
                f" groups {sorted(numbers)}); give each group its own number, 0 .. {self._groups - 1}: two groups with"
                " one number train on the same shard of the data"
            )
        if self._first and self._steps_before > 0 and max_step == 0:
            others = sorted(number for number in numbers if number != self._group)
            peers = f"groups {others}, also at step 0" if others else "no other group"
            raise ReplicaSetupError(
                f"replica group {self._group} had committed {self._steps_before} step(s) before its restart, but the"
                f" quorum has {peers}: the groups it would heal from have finished or lost their state, and it would"
                " train alone from step 0. It ends instead. To go on, load the job's checkpoint (fabric.load) before"
                " the first step; to start over, start every group anew"
            )

    def _no_quorum(self) -> str:
        seconds = self._quorum_timeout.total_seconds()
        answers = _answers(self._lighthouse)
        if answers:
            state = (
                "it accepts connections but gave no quorum: another group (or a rank of this group) never asked, or the"
                " lighthouse is overloaded"
            )
        else:
            state = "it does not answer (it is gone, or not reachable from here)"
        return (
            f"no quorum from the lighthouse at {self._lighthouse} within quorum_timeout={seconds:g} s: {state}. Keep"
            " the lighthouse running (a service manager restarts it on the same address; docs/fault_tolerance.md), or"
            " raise quorum_timeout to wait longer for it"
        )


def _member(name: str) -> dict[str, Any]:
    match = _ID.match(name.split(":", 1)[0])
    if match is None:
        raise ReplicaSetupError(
            f"a member of the quorum, {name.split(':', 1)[0]!r}, is not a replica group of a fabric job: every trainer"
            " that asks this lighthouse for a quorum must be one of this job's groups (give each job its own lighthouse)"
        )
    return {"strategy": match["strategy"], "groups": int(match["groups"]), "ranks": int(match["ranks"]), "group": int(match["group"])}


def _answers(lighthouse: str) -> bool:
    """Whether a TCP connection to the lighthouse's address is accepted (within a second)."""
    try:
        with socket.create_connection(lighthouse_address(lighthouse), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False
