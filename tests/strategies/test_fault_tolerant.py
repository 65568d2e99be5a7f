"""The ``ddp_ft`` strategy (torchft): its checks and bookkeeping first, then real replica groups in processes.

The jobs: one group alone whose process group across groups fails on demand (a dropped step changes nothing);
a lighthouse (``fabric-torch lighthouse``) and two one-process groups under ``fabric-torch run --max-restarts
1``, where group 1 kills itself mid-step and comes back healed; and a cold start of both groups from a
checkpoint that job wrote before the failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from fabric._core.env import LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS_ENV, REPLICA_GROUP_ENV
from fabric.strategies import STRATEGY_REGISTRY, strategy_launch
from fabric.strategies.fault_tolerant import (
    FaultTolerantStrategy,
    GroupPositions,
    HSDPFaultTolerantStrategy,
    import_torchft,
    replica_group_from_environment,
)
from support.environment import clean_env
from support.ft_jobs import processes_mentioning as _processes_mentioning
from support.ft_jobs import rows as _rows
from support.ft_jobs import run_groups, start_lighthouse, stop_lighthouse
from support.ft_jobs import shard_order as _shard_order
from support.loading import script_path
from support.processes import run

DIE_AT = 12  # group 1 kills itself in the step that would commit this one
SAVED_AT = (8, 10)  # the live job saves these committed steps, before the failure

GROUP = {REPLICA_GROUP_ENV: "1", NUM_REPLICA_GROUPS_ENV: "2", LIGHTHOUSE_ENV: "127.0.0.1:29510"}


def test_the_strategy_is_registered_and_started_one_process_per_device() -> None:
    assert STRATEGY_REGISTRY["ddp_ft"][0] == "fabric.strategies.fault_tolerant:FaultTolerantStrategy"
    assert strategy_launch("ddp_ft") == "per_device"


def test_the_replica_group_comes_from_the_environment_with_the_lighthouse_as_a_url() -> None:
    assert replica_group_from_environment(GROUP) == (1, 2, "http://127.0.0.1:29510")
    assert replica_group_from_environment({**GROUP, LIGHTHOUSE_ENV: "http://lh:1"})[2] == "http://lh:1"


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({REPLICA_GROUP_ENV: ""}, f"needs {REPLICA_GROUP_ENV} in the environment"),
        ({LIGHTHOUSE_ENV: ""}, f"needs {LIGHTHOUSE_ENV}"),
        ({REPLICA_GROUP_ENV: "one"}, "must be integers"),
        ({REPLICA_GROUP_ENV: "2"}, "0 <= group < groups"),
        ({NUM_REPLICA_GROUPS_ENV: "0", REPLICA_GROUP_ENV: "0"}, "0 <= group < groups"),
    ],
)
def test_a_missing_or_bad_replica_group_is_refused_naming_the_variable(change: dict[str, str], said: str) -> None:
    with pytest.raises(RuntimeError, match="fabric-torch run --replica-group" if "needs" in said else None) as info:
        replica_group_from_environment({**GROUP, **change})
    assert said in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"ddp_comm_hook": lambda state, bucket: None}, "ddp_comm_hook cannot be given"),
        ({"model_averaging_period": 2}, "model_averaging_period cannot be given"),
        ({"start_method": "spawn"}, "start_method='spawn' is not supported by 'ddp_ft'; accepted: 'popen'"),
        ({"min_replica_size": 0}, "min_replica_size=0 is not valid; accepted: an int >= 1"),
        ({"min_replica_size": True}, "min_replica_size=True is not valid"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, said: str) -> None:
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        FaultTolerantStrategy(**kwargs)


@pytest.mark.parametrize("sharding", ["HYBRID_SHARD", "NO_SHARD"])
def test_hsdp_ft_shards_only_inside_a_group(sharding: str) -> None:
    with pytest.raises(ValueError, match=f"sharding_strategy='{sharding}' is not supported by 'hsdp_ft'"):
        HSDPFaultTolerantStrategy(sharding_strategy=sharding)
    assert strategy_launch("hsdp_ft") == "per_device"
    with pytest.raises(ValueError, match="start_method='fork' is not supported by 'hsdp_ft'"):
        HSDPFaultTolerantStrategy(start_method="fork")


def test_ddp_never_rebuilds_its_buckets_so_every_group_lays_gradients_out_alike() -> None:
    assert FaultTolerantStrategy()._ddp_kwargs["find_unused_parameters"] is True


def test_without_torchft_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)
    monkeypatch.setitem(sys.modules, "torchft.manager", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'fabric-torch\[ft\]'"):
        import_torchft()


class _Loader:
    """What GroupPositions reads and sets of a FabricDataLoader."""

    def __init__(self, epoch: int, consumed: int) -> None:
        self.position = (epoch, consumed)
        self.continued: tuple[int, int] | None = None

    def data_position(self) -> tuple[int, int]:
        return self.position

    def continue_at(self, epoch: int, consumed: int) -> None:
        self.continued = self.position = (epoch, consumed)


def test_positions_keep_what_the_quorum_said_and_the_last_word_of_a_group_that_left() -> None:
    positions = GroupPositions(group=0, groups=3)
    loader = _Loader(0, 5)
    positions.add(loader)
    step = positions.contribution()
    assert step[0].tolist() == [[1, 5]] and step[1:].abs().sum() == 0  # only its own row
    positions.take(torch.tensor([[[1, 5]], [[1, 6]], [[2, 1]]]))  # all three groups took part
    loader.position = (0, 6)
    positions.take(torch.tensor([[[1, 6]], [[1, 7]], [[0, 0]]]))  # group 2 is gone: its last word stays
    assert positions.table.tolist() == [[[1, 6]], [[1, 7]], [[2, 1]]]


def test_healing_takes_a_peers_record_of_this_group_only_where_it_is_ahead() -> None:
    rejoined = GroupPositions(group=1, groups=2)
    fresh, ahead_here = _Loader(0, 0), _Loader(3, 2)
    rejoined.add(fresh)
    rejoined.add(ahead_here)
    peer_table = torch.tensor([[[1, 40], [3, 9]], [[1, 11], [2, 30]]])  # the peer heard group 1 at (0, 11) and (1, 30)
    rejoined.adopt(peer_table)
    assert fresh.continued == (0, 11)  # where it stood when it died
    assert ahead_here.continued is None  # it is further on its own: it keeps its place
    assert rejoined.table[0].tolist() == [[1, 40], [3, 9]]
    with pytest.raises(RuntimeError, match="every replica group must run the same script"):
        rejoined.adopt(torch.zeros(2, 3, 2, dtype=torch.int64))


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_dropped_step_leaves_weights_and_optimizer_as_they_were_and_backward_never_raises() -> None:
    import_torchft()
    result = run([sys.executable, str(script_path("ft", "dropped_step.py"))], timeout=100, env=clean_env(OMP_NUM_THREADS="1"))
    steps = json.loads(result.stdout.strip().splitlines()[-1])
    assert [step["failure"] for step in steps] == [None, "call", "wait", None]
    assert [step["committed"] for step in steps] == [1, 1, 1, 2]
    assert [step["weights_changed"] for step in steps] == [True, False, False, True]
    assert [step["optimizer_changed"] for step in steps] == [True, False, False, True]
    assert all(step["participants"] == 1 for step in steps)


def _job_with_a_failure(out: Path, strategy: str, devices: int) -> Path:
    """Group 1 (every rank) SIGKILLs itself after the forward of step 12 and is restarted once; group 0 goes on."""
    import_torchft()
    lighthouse, address = start_lighthouse(out / "lighthouse.log")
    try:
        results = run_groups(address, out, "--die-group", 1, "--die-at", DIE_AT, "--steps", 30, "--save-at", *SAVED_AT,
                             restarts=1, strategy=strategy, devices=devices)
    finally:
        lighthouse_status = stop_lighthouse(lighthouse)
    for group, (code, _, stderr) in enumerate(results):
        assert code == 0, f"group {group}: {stderr[-3000:]}"
    assert lighthouse_status == 0
    return out


@pytest.fixture(scope="module")
def live_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _job_with_a_failure(tmp_path_factory.mktemp("ft_live"), "ddp_ft", devices=1)


def _check_the_failure_and_the_healing(job: Path, ranks: int) -> None:
    for rank in range(ranks):
        survivor, died, rejoined = _rows(job, 0, 0, rank), _rows(job, 1, 0, rank), _rows(job, 1, 1, rank)
        assert not (job / f"group0_rank{rank}_attempt1.jsonl").exists()  # group 0 never stopped
        assert died[-1]["committed"] == DIE_AT - 1
        assert any(row["participants"] == 1 for row in survivor)  # it went on alone
        # the step under way when group 1 died was dropped: group 0 logged DIE_AT - 1 twice
        assert [row["committed"] for row in survivor].count(DIE_AT - 1) == 2
        # healed: the first step after the restart continues the peer's count, with both groups in the quorum
        first = rejoined[0]
        assert first["committed"] > DIE_AT and first["participants"] == 2
        assert (first["committed"], 2) in [(row["committed"], row["participants"]) for row in survivor]
        assert survivor[-1]["committed"] == rejoined[-1]["committed"] >= 30
        # rank `rank` of both groups ends with the same weights and optimizer state (the same shards under hsdp_ft)
        final = [torch.load(job / f"group{group}_rank{rank}_final.pt") for group in (0, 1)]
        for name, value in final[0]["model"].items():
            assert torch.equal(value, final[1]["model"][name]), (rank, name)
        for saved, other in zip(final[0]["optimizer"]["state"].values(), final[1]["optimizer"]["state"].values()):
            assert torch.equal(saved["momentum_buffer"], other["momentum_buffer"])
        # each group reads only its own shard, each sample once; the rejoined group from where it stood
        read = [index for row in died + rejoined for index in row["indices"]]
        assert read == _shard_order(1, rank, ranks)[: len(read)]
        assert rejoined[0]["indices"] == _shard_order(1, rank, ranks)[4 * (DIE_AT - 1) : 4 * DIE_AT]
        survived = [index for row in survivor for index in row["indices"]]
        assert survived == _shard_order(0, rank, ranks)[: len(survived)]
    assert _processes_mentioning(str(job)) == []  # no rank, launcher or lighthouse left


# the subject is a killed rank restarted by its launcher: fresh interpreters (`cold`), no warm ranks
@pytest.mark.procs
@pytest.mark.cold
@pytest.mark.timeout(300)
def test_a_group_that_dies_mid_step_leaves_the_other_training_and_comes_back_healed_where_it_stood(live_job: Path) -> None:
    _check_the_failure_and_the_healing(live_job, ranks=1)


@pytest.mark.procs
@pytest.mark.cold
@pytest.mark.timeout(300)
def test_hsdp_ft_two_groups_of_two_ranks_heal_shard_by_shard(tmp_path: Path) -> None:
    _check_the_failure_and_the_healing(_job_with_a_failure(tmp_path, "hsdp_ft", devices=2), ranks=2)


@pytest.mark.procs
@pytest.mark.cold
@pytest.mark.timeout(300)
def test_a_cold_start_of_every_group_from_one_groups_checkpoint_resumes_exactly(live_job: Path, tmp_path: Path) -> None:
    first, last = SAVED_AT
    lighthouse, address = start_lighthouse(tmp_path / "lighthouse.log")
    try:
        results = run_groups(address, tmp_path, "--resume", live_job / f"group0_step{first}.ckpt", "--steps", last)
    finally:
        stop_lighthouse(lighthouse)
    for group, (code, _, stderr) in enumerate(results):
        assert code == 0, f"group {group}: {stderr[-3000:]}"
    for group in (0, 1):
        resumed = _rows(tmp_path, group, 0)
        assert [row["committed"] for row in resumed] == list(range(first + 1, last + 1))
        # each group continues its own shard, though the file was group 0's
        assert [row["indices"] for row in resumed] == [row["indices"] for row in _rows(live_job, group, 0)[first:last]]
        expected = torch.load(live_job / f"group{group}_step{last}.ckpt", weights_only=False)["model"]
        final = torch.load(tmp_path / f"group{group}_rank0_final.pt")["model"]
        for name, value in final.items():
            assert torch.equal(value, expected[name]), (group, name)
