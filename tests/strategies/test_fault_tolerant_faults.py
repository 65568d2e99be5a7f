"""Fault tolerance under the faults other than a death, with real replica groups under ``fabric-torch run`` and a real
``fabric-torch lighthouse``: a hung rank and a stopped one, a lighthouse killed (with a quorum request under way) and
started again on its port, a lighthouse that never comes back, groups set up wrong (unequal sizes, one number
twice, a group restarted after its peers finished), what the job listens on and who the healing server answers,
and a checkpoint entry that does not fit.

The subject of every job here is processes ending, being stopped and restarted: fresh interpreters (``cold``).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from fabric.strategies.fault_tolerant import import_torchft
from support.environment import clean_env
from support.ft_jobs import processes_mentioning, rows, run_groups, start_groups, start_lighthouse, stop_lighthouse
from support.loading import script_path
from support.processes import finish, run, wait_for_files
from support.sockets import descendants, listening_addresses

pytestmark = [pytest.mark.procs, pytest.mark.cold]

FAULT_AT = 10  # the faulty group's step that would commit this one


def _equal_final_weights(out: Path, ranks: int = 1) -> None:
    for rank in range(ranks):
        final = [torch.load(out / f"group{group}_rank{rank}_final.pt") for group in (0, 1)]
        for name, value in final[0]["model"].items():
            assert torch.equal(value, final[1]["model"][name]), (rank, name)
        for saved, other in zip(final[0]["optimizer"]["state"].values(), final[1]["optimizer"]["state"].values()):
            assert torch.equal(saved["momentum_buffer"], other["momentum_buffer"])


@pytest.mark.timing
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["hang", "stop"])
def test_a_hung_or_stopped_rank_is_ended_within_its_step_timeout_and_its_group_heals(tmp_path: Path, fault: str) -> None:
    """A rank of group 1 hangs in a step (alive, heartbeating) or is stopped (SIGSTOP): its supervisor ends it after
    ``step_timeout`` with where it was, its launcher restarts it, and it heals; group 0 drops the step under way and
    commits alone meanwhile, and both end equal."""
    import_torchft()
    lighthouse, address = start_lighthouse(tmp_path / "lighthouse.log")
    try:
        results = run_groups(address, tmp_path, "--fault", fault, "--fault-group", 1, "--fault-at", FAULT_AT,
                             "--step-timeout", 3, "--steps", 24, restarts=1)
    finally:
        stop_lighthouse(lighthouse)
    for group, (code, _, stderr) in enumerate(results):
        assert code == 0, f"group {group}: {stderr[-3000:]}"
    stderr = results[1][2]
    assert "rank 0 made no progress for" in stderr and "(step_timeout=3 s)" in stderr, stderr[-3000:]
    if fault == "hang":
        assert "replica_group.py" in stderr and "time.sleep(3600)" in stderr  # where it was
    else:
        assert "did not answer the request for its stack (stopped" in stderr
    survivor, hung, rejoined = rows(tmp_path, 0, 0), rows(tmp_path, 1, 0), rows(tmp_path, 1, 1)
    assert hung[-1]["committed"] == FAULT_AT - 1
    assert any(row["participants"] == 1 for row in survivor)  # it went on alone
    assert [row["committed"] for row in survivor].count(FAULT_AT - 1) == 2  # the step under way was dropped
    assert rejoined[0]["committed"] > FAULT_AT and rejoined[0]["participants"] == 2  # healed
    assert survivor[-1]["committed"] == rejoined[-1]["committed"] >= 24
    _equal_final_weights(tmp_path)
    assert processes_mentioning(str(tmp_path)) == []


def _wait_for_log(log: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"{text!r} never appeared in {log}:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_a_lighthouse_killed_with_a_request_under_way_and_started_again_costs_no_group(tmp_path: Path) -> None:
    """With ``--min-replicas 2``, group 0's quorum request for step 10 waits at the lighthouse while group 1 pauses
    before asking: the lighthouse is SIGKILLed with that request under way, and started again on the same port. The
    request is asked again; no group restarts and both end with equal weights."""
    import_torchft()
    log = tmp_path / "lighthouse.log"
    lighthouse, address = start_lighthouse(log, min_replicas=2)
    port = int(address.rsplit(":", 1)[1])
    groups = start_groups(address, tmp_path, "--fault", "pause", "--fault-group", 1, "--fault-at", FAULT_AT, "--steps", 20)
    try:
        wait_for_files(tmp_path, "paused", 1, timeout=120)
        # group 0 asked for step 10's quorum: the lighthouse holds its request, waiting for a second group
        _wait_for_log(log, "only have 1 participants, need min_replicas 2", timeout=60)
        lighthouse.kill()
        lighthouse.wait(timeout=20)
        time.sleep(2)  # the request under way failed; the groups keep asking
        lighthouse, again = start_lighthouse(log, min_replicas=2, port=port)
        assert again == address
        (tmp_path / "go").touch()
        results = finish(groups, 150)
    finally:
        stop_lighthouse(lighthouse)
    for group, (code, _, stderr) in enumerate(results):
        assert code == 0, f"group {group}: {stderr[-3000:]}"
        assert "restarting" not in stderr
    for group in (0, 1):
        committed = [row["committed"] for row in rows(tmp_path, group, 0)]
        assert committed[FAULT_AT - 1 :] == list(range(FAULT_AT, committed[-1] + 1)), committed  # no step lost
        assert not (tmp_path / f"group{group}_rank0_attempt1.jsonl").exists()
    _equal_final_weights(tmp_path)


@pytest.mark.timing
@pytest.mark.timeout(120)
def test_a_lighthouse_that_never_comes_back_ends_every_group_with_our_message_within_the_bound(tmp_path: Path) -> None:
    import_torchft()
    lighthouse, address = start_lighthouse(tmp_path / "lighthouse.log", min_replicas=2)
    groups = start_groups(address, tmp_path, "--fault", "pause", "--fault-group", 1, "--fault-at", FAULT_AT, "--steps", 20,
                          "--step-timeout", 0, "--quorum-timeout", 8)
    wait_for_files(tmp_path, "paused", 1, timeout=120)
    _wait_for_log(tmp_path / "lighthouse.log", "only have 1 participants, need min_replicas 2", timeout=60)
    lighthouse.kill()
    lighthouse.wait(timeout=20)
    killed = time.monotonic()
    (tmp_path / "go").touch()
    results = finish(groups, 60)
    took = time.monotonic() - killed
    for code, _, stderr in results:
        assert code != 0
        assert f"no quorum from the lighthouse at {address} within quorum_timeout=8 s: it does not answer" in stderr, stderr[-3000:]
        assert "Keep the lighthouse running" in stderr
    assert took < 8 + 10, took  # the bound, plus the groups' ends


@pytest.mark.timing
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("numbers", "devices", "said"),
    [
        ((0, 1), (1, 2), "different numbers of ranks (group 0: 1, group 1: 2)"),
        ((0, 0), (1, 1), "2 replica groups of this job run as --replica-group 0"),
    ],
)
def test_groups_set_up_wrong_are_refused_in_seconds_naming_the_values(tmp_path: Path, numbers, devices, said) -> None:
    import_torchft()
    lighthouse, address = start_lighthouse(tmp_path / "lighthouse.log")
    started = time.monotonic()
    try:
        results = run_groups(address, tmp_path, "--steps", 200, "--end-alone", numbers=numbers, devices=devices, timeout=150)
    finally:
        stop_lighthouse(lighthouse)
    took = time.monotonic() - started
    for code, _, stderr in results:
        assert code != 0
        assert said in stderr, stderr[-3000:]
    assert took < 60, took  # seconds after both are up, not a gloo timeout


@pytest.mark.timeout(180)
def test_a_group_restarted_after_its_peers_finished_ends_instead_of_training_alone_from_step_0(tmp_path: Path) -> None:
    import_torchft()
    lighthouse, address = start_lighthouse(tmp_path / "lighthouse.log")
    try:
        results = run_groups(address, tmp_path, "--die-group", 1, "--die-at", 6, "--steps", 12, "--end-alone",
                             "--restart-after-finish", restarts=1)
    finally:
        stop_lighthouse(lighthouse)
    assert results[0][0] == 0, results[0][2][-3000:]
    code, _, stderr = results[1]
    assert code != 0
    assert "replica group 1 had committed 5 step(s) before its restart, but the quorum has no other group" in stderr, stderr[-3000:]
    assert (tmp_path / "group1_rank0_attempt1.jsonl").read_text() == ""  # it never took a step


@pytest.mark.timeout(180)
def test_a_running_job_listens_on_loopback_only_and_its_healing_server_answers_only_its_secret(tmp_path: Path) -> None:
    """Two groups of two ranks, held after step 3: every socket they and the lighthouse listen on is on loopback, and
    a request to a rank's healing server without the job's secret (or with another) is refused with nothing served."""
    import_torchft()
    from fabric.strategies.healing_transport import SECRET_HEADER

    lighthouse, address = start_lighthouse(tmp_path / "lighthouse.log")
    groups = start_groups(address, tmp_path, "--hold-at", 3, "--steps", 5, devices=2)
    try:
        held = wait_for_files(tmp_path, "holding_group*", 4, timeout=120)
        pids = descendants([process.pid for process in groups] + [lighthouse.pid])
        listening = listening_addresses(pids)
        # each rank: its healing server; each group: its store and manager server; gloo; the lighthouse
        assert len(listening) >= 4 + 2 + 2 + 1, listening
        assert {host for host, _, _ in listening} == {"127.0.0.1"}, listening
        for marker in held:
            url = f"{marker.read_text()}3"
            assert url.startswith("http://127.0.0.1:")
            for headers in ({}, {SECRET_HEADER: "not the job's secret at all"}):
                with pytest.raises(urllib.error.HTTPError) as refused:
                    urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10).close()
                assert refused.value.code == 403
                assert len(refused.value.read()) < 1000  # an error page, nothing served
        (tmp_path / "go").touch()
        results = finish(groups, 120)
    finally:
        stop_lighthouse(lighthouse)
    for group, (code, _, stderr) in enumerate(results):
        assert code == 0, f"group {group}: {stderr[-3000:]}"


@pytest.mark.timeout(120)
def test_a_checkpoint_entry_that_does_not_fit_is_refused_before_anything_changes(tmp_path: Path) -> None:
    import_torchft()
    result = run([sys.executable, str(script_path("ft", "entry_check.py")), str(tmp_path)], timeout=100,
                 env=clean_env(OMP_NUM_THREADS="1"))
    checks = json.loads(result.stdout.strip().splitlines()[-1])
    assert checks["error"] == "CheckpointMismatchError"
    assert "the table of data positions has the shape (1, 1, 2) (groups, dataloaders, 2); this job's is (1, 2, 2)" in checks["message"]
    assert checks["model_unchanged"] and checks["optimizer_unchanged"] and checks["step_unchanged"]
    assert checks["plain_load_left_step"] and checks["plain_load_left_loader"] and checks["plain_load_returned_entry"]
    assert checks["resumed_step"] == checks["saved_step"] > 0  # and a fitting one loads
