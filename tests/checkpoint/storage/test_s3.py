"""Checkpoints on a real S3-compatible server (moto's server mode) on 127.0.0.1, reached by s3fs over HTTP.

The server is started once for this module on a free port and stopped at the end; s3fs finds it through
``AWS_ENDPOINT_URL`` and takes dummy credentials from the environment, set only while these tests run.
Single files, then sharded checkpoints: saved by one process, and by 2-process FSDP jobs under torchrun
whose ranks reach the server through the same variables.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric._core.urls import filesystem
from fabric.checkpoint.errors import CheckpointLoadError
from fabric.checkpoint.storage import objects as storage
from fabric.plugins.io import atomic_save, safe_load
from support.environment import free_port
from support.s3 import VARIABLES, MotoS3

pytestmark = pytest.mark.usefixtures("clean_fabric_env")

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

@pytest.fixture
def bucket(s3_bucket: str) -> str:
    """A new, empty bucket on the module's moto server (``support/s3.py``)."""
    return s3_bucket


def cpu_fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(net.parameters())
    net(torch.ones(2, 16)).sum().backward()
    optimizer.step()
    return net, optimizer


def the_object(url: str) -> str:
    fs, path = filesystem(url)
    record = json.loads(fs.cat_file(path))
    return f"{storage.generation_prefix(path, record['generation'])}/{storage.FILE_OBJECT}"


def test_round_trip_lands_in_the_bucket(bucket: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fabric = cpu_fabric()
    net, optimizer = trained()
    url = f"{bucket}/run/ckpt.pt"
    fabric.save(url, {"model": net, "optimizer": optimizer, "step": 3})
    assert os.listdir(tmp_path) == []  # nothing local
    fs, path = filesystem(url)
    assert fs.exists(path) and fs.exists(the_object(url))
    fresh = nn.Linear(16, 8)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    assert fabric.load(url, {"model": fresh, "optimizer": fresh_optimizer}) == {"step": 3}
    assert torch.equal(fresh.weight, net.weight)
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg_sq"], optimizer.state_dict()["state"][0]["exp_avg_sq"])
    raw = nn.Linear(16, 8)
    atomic_save(net.state_dict(), f"{bucket}/bare.pt")
    fabric.load_raw(f"{bucket}/bare.pt", raw)
    assert torch.equal(raw.bias, net.bias)


def test_async_save(bucket: str) -> None:
    fabric = cpu_fabric()
    net, _ = trained()
    url = f"{bucket}/async.pt"
    fabric.save(url, {"model": net}, async_save=True)
    fresh = nn.Linear(16, 8)
    fabric.load(url, {"model": fresh})
    assert torch.equal(fresh.weight, net.weight)


def test_older_generation_removed_after_commit(bucket: str) -> None:
    url = f"{bucket}/gen.pt"
    fs, _ = filesystem(url)
    atomic_save({"v": torch.zeros(4)}, url)
    first = the_object(url)
    atomic_save({"v": torch.ones(4)}, url)
    fs.invalidate_cache()
    assert not fs.exists(first)
    assert torch.equal(safe_load(url)["v"], torch.ones(4))


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_save"])
def test_damaged_object_refused_nothing_changed(bucket: str, damage: str) -> None:
    fabric = cpu_fabric()
    net, _ = trained()
    url, other = f"{bucket}/damaged.pt", f"{bucket}/other.pt"
    fabric.save(url, {"model": net})
    fs, _ = filesystem(url)
    target = the_object(url)
    data = bytearray(fs.cat_file(target))
    if damage == "flip":
        data[len(data) // 2] ^= 0x04
        fs.pipe_file(target, bytes(data))
    elif damage == "truncate":
        fs.pipe_file(target, bytes(data[: len(data) // 2]))
    else:
        with torch.no_grad():
            net.weight.add_(1)
        fabric.save(other, {"model": net})
        fs.pipe_file(target, fs.cat_file(the_object(other)))
    fresh = nn.Linear(16, 8)
    before = fresh.state_dict()
    with pytest.raises(storage.CorruptCheckpointError, match=r"damaged\.pt"):  # (the disk's class for it)
        fabric.load(url, {"model": fresh})
    assert all(torch.equal(value, fresh.state_dict()[key]) for key, value in before.items())


def test_checkpoint_without_commit_record_refused(bucket: str) -> None:
    url = f"{bucket}/norecord.pt"
    fs, path = filesystem(url)
    atomic_save({"v": torch.ones(2)}, url)
    fs.rm(path)
    with pytest.raises(FileNotFoundError, match="no commit record"):
        safe_load(url)


def test_a_bucket_that_does_not_exist(bucket: str) -> None:
    with pytest.raises(OSError, match="nosuchbucket-fabric"):
        atomic_save({"v": 1}, "s3://nosuchbucket-fabric/x.pt")


def test_server_stopped_mid_save_clear_error_previous_intact(tmp_path) -> None:
    """A server of its own (stopped in the middle of a save): the save fails within a bound, the previous checkpoint
    is whole on the restarted server."""
    import s3fs

    server = MotoS3()
    server.start()
    saved = {name: os.environ.get(name) for name in VARIABLES}
    os.environ.update(server.environment())
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        # short timeouts and few retries, as a job that must not hang on a dead store would set
        os.environ["AWS_MAX_ATTEMPTS"] = "2"
        s3fs.S3FileSystem(config_kwargs={"connect_timeout": 2, "read_timeout": 5}).mkdir("stops")
        url = "s3://stops/ckpt.pt"
        atomic_save({"v": torch.arange(10.0)}, url)
        previous = json.loads(s3fs.S3FileSystem().cat_file("stops/ckpt.pt"))
        big = {"v": torch.zeros(64 << 20, dtype=torch.uint8)}  # 64 MB: several multipart uploads
        stopper = threading.Timer(0.3, server.stop)
        stopper.start()
        started = time.monotonic()
        with pytest.raises(OSError, match=r"Could not save the checkpoint 's3://stops/ckpt.pt'.*previous checkpoint"):
            atomic_save(big, url)
        assert time.monotonic() - started < 120
        stopper.join()
        # the same store served again (moto keeps its buckets in this process): the previous checkpoint is whole
        again = MotoS3()
        again.start()
        try:
            os.environ["AWS_ENDPOINT_URL"] = again.endpoint
            s3fs.S3FileSystem.clear_instance_cache()
            assert torch.equal(safe_load(url)["v"], torch.arange(10.0))
            assert json.loads(s3fs.S3FileSystem().cat_file("stops/ckpt.pt")) == previous
        finally:
            again.stop()
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        os.environ.pop("AWS_MAX_ATTEMPTS", None)
        s3fs.S3FileSystem.clear_instance_cache()


def test_consolidate_to_a_bucket(bucket: str, tmp_path) -> None:
    """``fabric-torch consolidate`` writes nothing for a missing folder (the file on the bucket: below)."""
    from fabric.consolidate import main

    assert main([str(tmp_path / "missing"), f"{bucket}/full.pt"]) == 1
    with pytest.raises(FileNotFoundError):
        safe_load(f"{bucket}/full.pt")


# ---- sharded checkpoints on the bucket ------------------------------------------------------------------


def store_job(url: str, out, *args: str, tmpdir) -> None:
    """``support/scripts/dcp/store_job.py`` as a 2-process FSDP job under torchrun; the ranks reach this module's S3
    server through the environment, and keep their staging folders in ``tmpdir`` (checked empty afterwards)."""
    import subprocess
    import sys

    from support.environment import clean_env
    from support.loading import script_path

    tmpdir.mkdir(exist_ok=True)
    env = clean_env(
        OMP_NUM_THREADS="1",
        TMPDIR=str(tmpdir),
        **{name: os.environ[name] for name in VARIABLES},
    )
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
         str(script_path("dcp", "store_job.py")), url, str(out), *args],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert [name for name in os.listdir(tmpdir) if name.startswith(storage.STAGING_PREFIX)] == [], "a staging folder was left"


def plain_job_objects(seed: int = 5) -> tuple[nn.Module, torch.optim.Optimizer]:
    from support.dcp_jobs import job_model

    torch.manual_seed(seed)
    model = job_model()
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def assert_holds(model: nn.Module, optimizer: torch.optim.Optimizer, reference: dict) -> None:
    for name, value in reference["model"].items():
        assert torch.equal(model.state_dict()[name], value), name
    state = optimizer.state_dict()["state"]
    assert state.keys() == reference["optimizer"]["state"].keys()
    for number, entry in reference["optimizer"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(state[number][name]), torch.as_tensor(value)), (number, name)


def assert_same(loaded: dict, reference: dict) -> None:
    for name, value in reference["model"].items():
        assert torch.equal(loaded["model"][name], value), name
    for number, entry in reference["optimizer"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(loaded["optimizer"]["state"][number][name]), torch.as_tensor(value)), (number, name)


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_two_process_fsdp_sharded_saves_sync_async_and_a_failed_one_then_loads_on_two_and_on_one(bucket: str, tmp_path) -> None:
    """On the bucket: a 2-process FSDP job saves sharded (sync, then async), then a save in which rank 1's upload
    fails: every rank raises, the previous checkpoint loads with its exact values. Then 2 -> 2 processes, 2 -> 1
    (a plain module in this process) and 1 -> 2 (saved here without processes) load what was saved."""
    from fabric.checkpoint.formats import load_sharded
    from fabric.checkpoint.formats.sharded import save_sharded

    out = tmp_path / "out"
    out.mkdir()
    store_job(f"{bucket}/run", out, "save", tmpdir=tmp_path / "tmp")
    for rank in range(2):
        failed = (out / f"failed-rank{rank}.txt").read_text()
        assert failed.startswith("RuntimeError") and "previous one is kept" in failed, failed
        assert "uploading rank 1's part failed" in failed and "injected" in failed, failed
    reference = {name: torch.load(out / f"ref-{name}.pt", weights_only=True) for name in ("sync", "async")}
    after = torch.load(out / "after-failure.pt", weights_only=True)
    assert after["step"] == 3
    assert_same(after, reference["sync"])
    fs, path = filesystem(f"{bucket}/run/sync")
    record = json.loads(fs.cat_file(path))
    assert record["kind"] == "sharded"
    data_files = [f"__{rank}_{number}.distcp" for rank in range(2) for number in range(4)]
    assert sorted(record["objects"]) == sorted([".metadata", *data_files, "fabric-objects.pt"])
    fs.invalidate_cache()
    assert [entry.rsplit("/", 1)[-1] for entry in fs.ls(f"{path}{storage.DATA_SUFFIX}")] == [record["generation"]]

    for name in ("sync", "async"):  # 2 -> 1: a plain model and optimizer in this process
        model, optimizer = plain_job_objects()
        state = {"model": model, "optimizer": optimizer, "step": 0}
        load_sharded(f"{bucket}/run/{name}", state)
        assert state["step"] == {"sync": 3, "async": 4}[name]
        assert_holds(model, optimizer, reference[name])

    model, optimizer = plain_job_objects(seed=9)  # 1 -> 2: saved here, one process, no process group
    model(torch.ones(2, 6)).sum().backward()
    optimizer.step()
    save_sharded(f"{bucket}/run/one", {"model": model, "optimizer": optimizer, "step": 11})
    single = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    store_job(f"{bucket}/run", out, "load", "async", "one", tmpdir=tmp_path / "tmp")
    # rank 0 reads each commit record once and every rank adopts what it found: one GET of the record per load
    assert [int((out / f"record-reads-rank{rank}.txt").read_text()) for rank in (0, 1)] == [2, 0]
    loaded = torch.load(out / "loaded-async.pt", weights_only=True)
    assert loaded["step"] == 4
    assert_same(loaded, reference["async"])
    loaded = torch.load(out / "loaded-one.pt", weights_only=True)
    assert loaded["step"] == 11
    assert_same(loaded, single)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_two_process_model_parallel_sharded_checkpoint_on_the_bucket(bucket: str, tmp_path) -> None:
    """ModelParallelStrategy (tensor parallel over 2 processes) saves its DCP shards to the bucket and loads them back;
    a plain module in this process loads them too (2 -> 1)."""
    from fabric.checkpoint.formats import load_sharded
    from support.scripts.sharding.model import make_net

    out = tmp_path / "out"
    out.mkdir()
    store_job(f"{bucket}/run", out, "tp", tmpdir=tmp_path / "tmp")
    reference = torch.load(out / "ref-tp.pt", weights_only=True)
    loaded = torch.load(out / "loaded-tp.pt", weights_only=True)
    assert loaded["step"] == 2
    assert_same(loaded, reference)
    model = make_net(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    load_sharded(f"{bucket}/run/tp", state)
    assert state["step"] == 2
    assert_holds(model, optimizer, reference)


def sharded_url_and_state(bucket: str, name: str = "sharded", seed: int = 5) -> tuple[str, nn.Module, torch.optim.Optimizer]:
    """A sharded checkpoint saved on the bucket by one process (no process group), with what it holds."""
    from fabric.checkpoint.formats.sharded import save_sharded

    model, optimizer = plain_job_objects(seed)
    model(torch.ones(2, 6)).sum().backward()
    optimizer.step()
    url = f"{bucket}/{name}"
    save_sharded(url, {"model": model, "optimizer": optimizer, "step": 4})
    return url, model, optimizer


def sharded_object(url: str, name: str) -> str:
    fs, path = filesystem(url)
    record = json.loads(fs.cat_file(path))
    return f"{storage.generation_prefix(path, record['generation'])}/{name}"


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_save", "no_record"])
def test_damaged_sharded_checkpoint_on_the_bucket_refused_nothing_changed(bucket: str, damage: str) -> None:
    url, *_ = sharded_url_and_state(bucket)
    fs, path = filesystem(url)
    target = sharded_object(url, "__0_0.distcp")
    data = bytearray(fs.cat_file(target))
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        fs.pipe_file(target, bytes(data))
        expected = r"__0_0\.distcp.*do not match the CRC-32 in the commit record"
    elif damage == "truncate":
        fs.pipe_file(target, bytes(data[: len(data) // 2]))
        expected = r"__0_0\.distcp.* has \d+ bytes, the commit record says"
    elif damage == "other_save":
        other, *_ = sharded_url_and_state(bucket, "other", seed=6)
        fs.pipe_file(target, fs.cat_file(sharded_object(other, "__0_0.distcp")))
        expected = r"__0_0\.distcp.*do not match the CRC-32 in the commit record \(damaged, or from another save\)"
    else:
        fs.rm(path)
        expected = "no commit record"
    fresh, fresh_optimizer = plain_job_objects(seed=7)
    before = {name: value.clone() for name, value in fresh.state_dict().items()}
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    with pytest.raises((RuntimeError, FileNotFoundError), match=expected) as info:
        cpu_fabric().load(url, state)
    assert f"{bucket}/sharded" in str(info.value)
    assert all(torch.equal(value, fresh.state_dict()[name]) for name, value in before.items())
    assert state["step"] == 0 and not fresh_optimizer.state


def test_consolidate_a_sharded_checkpoint_from_a_bucket_to_a_file_and_to_the_bucket(bucket: str, tmp_path) -> None:
    from fabric.consolidate import main

    url, model, optimizer = sharded_url_and_state(bucket)
    assert main([url, str(tmp_path / "full.pt")]) == 0
    assert main([url, f"{bucket}/full.pt"]) == 0
    for full in (torch.load(tmp_path / "full.pt", weights_only=True), safe_load(f"{bucket}/full.pt")):
        assert full["step"] == 4
        assert all(torch.equal(full["model"][name], value) for name, value in model.state_dict().items())
        assert torch.equal(full["optimizer"]["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert main([f"{bucket}/full.pt", str(tmp_path / "again.pt")]) == 1  # a file, not a sharded checkpoint


_OUTSIDE_WRITER = """
import sys, torch
from fabric import Fabric
from fabric._core.urls import filesystem
from fabric.checkpoint.storage import objects as storage
url, how = sys.argv[1], sys.argv[2]
if how == "save":
    Fabric(accelerator="cpu", devices=1).save(url, {"model": {"w": torch.full((64,), 2.0)}})
else:  # flip a byte of the checkpoint's data object in place
    fs, path = filesystem(url)
    import json
    record = json.loads(fs.cat_file(path))
    target = storage.generation_prefix(path, record["generation"]) + "/" + storage.FILE_OBJECT
    data = bytearray(fs.cat_file(target))
    data[len(data) // 2] ^= 0x10
    fs.pipe_file(target, bytes(data))
"""


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_checkpoint_another_process_replaced_or_changed_after_this_one_read_it(bucket: str) -> None:
    # this process reads the checkpoint (s3fs keeps what it learnt of the objects); another process then saves
    # anew to the same URL, then damages it: the next loads here read the new save, then refuse the damaged one
    # with our error, never s3fs's raw FileExpired nor a stale copy
    import subprocess
    import sys

    from support.environment import clean_env

    fabric = cpu_fabric()
    url = f"{bucket}/shared.pt"
    fabric.save(url, {"model": {"w": torch.full((64,), 1.0)}})
    assert torch.equal(fabric.load(url)["model"]["w"], torch.full((64,), 1.0))
    env = clean_env(**{name: os.environ[name] for name in VARIABLES})
    for how in ("save", "flip"):
        subprocess.run([sys.executable, "-c", _OUTSIDE_WRITER, url, how], env=env, check=True, timeout=90, capture_output=True)
        if how == "save":
            assert torch.equal(fabric.load(url)["model"]["w"], torch.full((64,), 2.0))
    state = {"model": {"w": torch.zeros(64)}}
    with pytest.raises(storage.CorruptCheckpointError, match=r"shared\.pt.*CRC-32"):
        fabric.load(url, state)
    assert torch.equal(state["model"]["w"], torch.zeros(64))


# ---- URLs with a query or a fragment; objects damaged after a load in this process -------------------------------

QUERY_SECRET = "fabricQuerySecret123"


@pytest.mark.parametrize("suffix", [f"?X-Amz-Signature={QUERY_SECRET}", "#part"], ids=["query", "fragment"])
def test_a_url_with_a_query_or_fragment_is_refused_naming_it_without_the_secret_and_nothing_is_written(
    bucket: str, tmp_path, suffix: str
) -> None:
    # a query (a signed URL's token) would otherwise become part of every object's name, readable by whoever lists the bucket
    import traceback

    from fabric.checkpoint.async_save import wait_for_pending_save
    from fabric.checkpoint.formats.sharded import save_sharded
    from fabric.consolidate import consolidate
    from fabric.loggers import CSVLogger, TensorBoardLogger
    from support.s3 import s3_objects

    local = tmp_path / "sharded"
    save_sharded(local, {"model": nn.Linear(2, 2)})
    fabric, net = cpu_fabric(), nn.Linear(2, 2)
    url, logs = f"{bucket}/run/ckpt.pt{suffix}", f"{bucket}/logs{suffix}"
    actions = {
        "save": (url, lambda: fabric.save(url, {"model": net})),
        "async save": (url, lambda: (fabric.save(url, {"model": net}, async_save=True), wait_for_pending_save())),
        "sharded save": (url, lambda: save_sharded(url, {"model": net})),
        "load": (url, lambda: fabric.load(url, {"model": net})),
        "consolidate's output": (url, lambda: consolidate(local, url)),
        "CSVLogger": (logs, lambda: CSVLogger(logs).log_metrics({"loss": 1.0}, step=0)),
        "TensorBoardLogger": (logs, lambda: TensorBoardLogger(logs).log_metrics({"loss": 1.0}, step=0)),
    }
    for what, (given, action) in actions.items():
        with pytest.raises(ValueError, match=r"has a (query|fragment)") as info:
            action()
        text = str(info.value) + "".join(traceback.format_exception(info.value))
        assert QUERY_SECRET not in text, (what, text)
        shown = given.replace(QUERY_SECRET, "").replace("X-Amz-Signature=", "***")
        kind = "query" if "?" in given else "fragment"
        assert f"{shown!r} has a {kind}" in str(info.value) and "Accepted: a URL without '?' or '#'" in str(info.value), (what, text)
    assert s3_objects(bucket) == {}


_FRESH_LOADS = """
import sys
from fabric import Fabric
for url in sys.argv[1:]:
    try:
        Fabric(accelerator="cpu", devices=1).load(url)
        print("loaded")
    except Exception as err:
        print(f"{type(err).__name__}: {err}")
"""


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_an_object_deleted_or_truncated_after_a_load_in_this_process_gives_the_message_a_fresh_process_gives(bucket: str) -> None:
    # this process has loaded (and saved) each checkpoint, so s3fs's listing cache knows its objects; another client
    # then deletes or truncates one. The load here must ask the store, not the cache: our message, the same as a
    # fresh process's, never s3fs's raw "The specified key does not exist" nor "The requested range is not satisfiable"
    import subprocess
    import sys

    import s3fs

    from support.environment import clean_env

    fabric = cpu_fabric()
    urls, expected = [], []
    for kind in ("file", "sharded"):
        for damage in ("delete", "truncate"):
            if kind == "file":
                url = f"{bucket}/{kind}-{damage}.pt"
                fabric.save(url, {"model": {"w": torch.arange(4096.0)}})
                target = the_object(url)
            else:
                url, *_ = sharded_url_and_state(bucket, f"{kind}-{damage}")
                target = sharded_object(url, "__0_0.distcp")
            fabric.load(url)  # the warm part: this process has read every object of it
            outsider = s3fs.S3FileSystem(skip_instance_cache=True)  # as another process: nothing here hears of it
            if damage == "delete":
                outsider.rm(target)
                expected.append(r"is missing: the commit record lists it \(\d+ bytes\)")
            else:
                outsider.pipe_file(target, outsider.cat_file(target)[:100])
                expected.append(r"has 100 bytes, the commit record says \d+ \(truncated, or from another save\)")
            urls.append(url)

    warm = []
    for url, said in zip(urls, expected):
        with pytest.raises(CheckpointLoadError, match=said) as info:  # a sharded read names the rank: its own class
            fabric.load(url)
        assert repr(url) in str(info.value)
        warm.append(f"{type(info.value).__name__}: {info.value}")
    env = clean_env(**{name: os.environ[name] for name in VARIABLES})
    fresh = subprocess.run([sys.executable, "-c", _FRESH_LOADS, *urls], env=env, capture_output=True, text=True, timeout=150)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert fresh.stdout.splitlines() == warm
