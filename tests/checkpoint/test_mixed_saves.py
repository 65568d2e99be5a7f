"""A sharded folder assembled from files of different saves is refused, naming the file that does not belong.

Every save records, in its objects file, a save id and each data file's name, size and a digest of its
records' CRC-32s (``safe_reader.data_files_of``); a load, a whole read and ``fabric-torch consolidate``
compare before anything is read. Cases: one rank's shard file from an older save, two ranks' files
swapped or one copied over the other, the index and objects file of one save with the shards of another,
a folder mixed with its own spare; on one process, under 2-process FSDP, and assembled at random.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fabric.checkpoint import integrity
from fabric.checkpoint.formats import load_sharded
from fabric.checkpoint.formats import shard_reader as safe_reader
from fabric.checkpoint.formats.file import CheckpointLoadError
from fabric.checkpoint.formats.shard_reader import INDEX_FILE, OBJECTS_FILE
from fabric.checkpoint.formats.sharded import save_sharded
from fabric.checkpoint.storage.disk import SPARE_PREFIX
from fabric.consolidate import main as consolidate_main
from fabric.plugins.io import atomic_save
from support.dcp_jobs import run_job

SHARD = "__0_0.distcp"


def stepped(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 16)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    values = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for number, entry in optimizer.state_dict()["state"].items():
        values.update({f"state{number}.{k}": torch.as_tensor(v).clone() for k, v in entry.items()})
    return values


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory) -> Path:
    """One model saved at step 1 (``a``), then at step 2 into ``a`` again and into ``b``: ``a``'s spare is step 1."""
    root = tmp_path_factory.mktemp("two-saves")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters())
    stepped(model, optimizer)
    save_sharded(root / "a", {"model": model, "optimizer": optimizer, "step": 1})
    shutil.copytree(root / "a", root / "older")
    stepped(model, optimizer)
    save_sharded(root / "a", {"model": model, "optimizer": optimizer, "step": 2})  # the step-1 folder becomes the spare
    save_sharded(root / "b", {"model": model, "optimizer": optimizer, "step": 2})
    return root


def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters())
    stepped(model, optimizer)
    return model, optimizer


def refused_naming(folder: Path, name: str) -> None:
    """A load into live objects and a whole read both refuse ``folder`` naming ``name``; nothing changes."""
    model, optimizer = fresh()
    before = snapshot(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    with pytest.raises(CheckpointLoadError, match=f"{name}.*does not belong|does not match the checksum") as refusal:
        load_sharded(folder, state)
    assert name in str(refusal.value) and str(folder) in str(refusal.value)
    assert same(before, snapshot(model, optimizer)) and state["step"] == 0
    with pytest.raises(CheckpointLoadError, match=name):
        load_sharded(folder)


def test_every_save_records_its_id_and_each_data_files_size_and_digest(two_saves):
    objects = torch.load(two_saves / "a" / OBJECTS_FILE, weights_only=True)
    other = torch.load(two_saves / "b" / OBJECTS_FILE, weights_only=True)
    assert objects["save_id"] != other["save_id"]
    assert set(objects["data_files"]) == {SHARD}
    assert objects["data_files"][SHARD]["bytes"] == (two_saves / "a" / SHARD).stat().st_size
    # the same values saved twice: the same records, so the same digest (a harmless swap)
    assert objects["data_files"][SHARD]["records_crc32"] == other["data_files"][SHARD]["records_crc32"]


def test_a_shard_file_from_an_older_save_is_refused_naming_it(two_saves, tmp_path):
    folder = tmp_path / "mixed"
    shutil.copytree(two_saves / "a", folder)
    shutil.copy(two_saves / "older" / SHARD, folder / SHARD)
    refused_naming(folder, SHARD)


def test_a_folder_mixed_with_its_own_spare_is_refused_naming_the_file(two_saves, tmp_path):
    spare = two_saves / f"{SPARE_PREFIX}a"
    assert spare.is_dir()
    folder = tmp_path / "mixed"
    shutil.copytree(two_saves / "a", folder)
    shutil.copy(spare / SHARD, folder / SHARD)
    refused_naming(folder, SHARD)


def test_the_index_and_objects_of_one_save_with_the_shards_of_another_are_refused(two_saves, tmp_path):
    folder = tmp_path / "mixed"
    shutil.copytree(two_saves / "older", folder)  # step 1's index and objects file
    shutil.copy(two_saves / "a" / SHARD, folder / SHARD)  # step 2's tensors
    refused_naming(folder, SHARD)
    folder = tmp_path / "mixed-index"
    shutil.copytree(two_saves / "a", folder)
    shutil.copy(two_saves / "older" / INDEX_FILE, folder / INDEX_FILE)
    refused_naming(folder, INDEX_FILE)


def test_a_shard_file_of_another_size_is_named_with_both_sizes(two_saves, tmp_path):
    folder = tmp_path / "mixed"
    shutil.copytree(two_saves / "a", folder)
    with open(folder / SHARD, "ab") as file:
        file.write(b"\0" * 10)
    with pytest.raises(CheckpointLoadError, match=rf"{SHARD}.*does not belong.*has \d+ bytes, that save wrote \d+"):
        load_sharded(folder)


def test_ranks_that_agree_afterwards_share_the_digest_checks_between_them(two_saves, tmp_path):
    folder = tmp_path / "mixed"
    shutil.copytree(two_saves / "a", folder)
    shutil.copy(two_saves / "older" / SHARD, folder / SHARD)
    objects = torch.load(folder / OBJECTS_FILE, weights_only=True)
    index = safe_reader.read_index(folder)

    def check(share: tuple[int, int] | None) -> None:
        safe_reader.check_data_files_belong(folder, index, objects["save_id"], objects["data_files"], share)

    for share in (None, (0, 1), (0, 2)):  # the one data file is the first rank's to check
        with pytest.raises(CheckpointLoadError, match=SHARD):
            check(share)
    check((1, 2))  # the second rank leaves it to the first (the load walk's agreement tells it the outcome)


def test_a_damaged_archive_directory_is_named_as_damage(two_saves, tmp_path):
    folder = tmp_path / "damaged"
    shutil.copytree(two_saves / "a", folder)
    data = bytearray((folder / SHARD).read_bytes())
    end = data.rfind(b"PK\x05\x06")  # the last item's end-of-directory record
    data[end : end + 4] = b"XXXX"
    (folder / SHARD).write_bytes(bytes(data))
    with pytest.raises(CheckpointLoadError, match=rf"{SHARD}.*is damaged"):
        load_sharded(folder)


def test_a_folder_saved_before_the_binding_loads_and_says_so_once(two_saves, tmp_path, monkeypatch):
    folder = tmp_path / "legacy"
    shutil.copytree(two_saves / "a", folder)
    objects = torch.load(folder / OBJECTS_FILE, weights_only=True)
    del objects["save_id"], objects["data_files"]
    atomic_save(objects, folder / OBJECTS_FILE)
    monkeypatch.setattr(integrity, "_said", set())
    with pytest.warns(UserWarning, match="cannot be detected"):
        assert load_sharded(folder)["step"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_sharded(folder)["step"] == 2


def test_consolidate_refuses_a_mixed_folder_and_writes_nothing(two_saves, tmp_path, capsys):
    folder = tmp_path / "mixed"
    shutil.copytree(two_saves / "a", folder)
    shutil.copy(two_saves / "older" / SHARD, folder / SHARD)
    out = tmp_path / "full.pt"
    assert consolidate_main([str(folder), str(out)]) == 1
    assert SHARD in capsys.readouterr().err and not out.exists()
    assert consolidate_main([str(two_saves / "a"), str(out)]) == 0 and out.is_file()


# ---- two processes under FSDP -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_twice_on_two(tmp_path_factory) -> Path:
    """A real 2-process FSDP job's two saves of one model: ``gen-a`` (step 3) and ``gen-b`` (step 4)."""
    out = tmp_path_factory.mktemp("dcp-two-saves")
    run_job(2, str(out), "save_two")
    return out


def assemble(saves: Path, folder: Path, picks: dict[str, tuple[str, str]]) -> None:
    """``folder`` made of ``picks``: each file name -> (save folder name, the file name there)."""
    folder.mkdir()
    for name, (save, source) in picks.items():
        shutil.copy(saves / save / source, folder / name)


NAMES = [INDEX_FILE, OBJECTS_FILE, "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mix", ["older", "swapped", "copied", "objects-of-a"])
def test_a_mixed_folder_is_refused_on_both_ranks_under_fsdp_and_changes_nothing(saved_twice_on_two, tmp_path, mix):
    picks = {name: ("gen-b", name) for name in NAMES}
    if mix == "older":
        picks["__1_0.distcp"] = ("gen-a", "__1_0.distcp")
    elif mix == "swapped":
        picks["__0_0.distcp"], picks["__1_0.distcp"] = ("gen-b", "__1_0.distcp"), ("gen-b", "__0_0.distcp")
    elif mix == "copied":
        picks["__1_0.distcp"] = ("gen-b", "__0_0.distcp")
    else:
        picks[INDEX_FILE], picks[OBJECTS_FILE] = ("gen-a", INDEX_FILE), ("gen-a", OBJECTS_FILE)
    if mix == "older":  # the same rank's file of another save: the same size, only the records' CRCs differ
        sizes = {(saved_twice_on_two / save / "__1_0.distcp").stat().st_size for save in ("gen-a", "gen-b")}
        assert len(sizes) == 1
    # (rank 0 also writes the replicated optimizer steps here, so a swap changes sizes too: either is refused)
    folder = tmp_path / "sharded"
    assemble(saved_twice_on_two, folder, picks)
    if mix != "older":  # one 2-process job per kind of refusal is enough; the rest are read in this process
        with pytest.raises(CheckpointLoadError, match=r"__[01]_0\.distcp.*does not belong"):
            load_sharded(folder)
        return
    run_job(2, str(tmp_path), "load_damaged", str(folder))
    for rank in (0, 1):
        report = json.loads((tmp_path / f"damaged-rank{rank}.json").read_text())
        assert report["error"] is not None, f"rank {rank} loaded a mixed checkpoint"
        assert "__1_0.distcp" in report["error"] and "does not belong" in report["error"], report["error"]
        assert report["unchanged"] and report["tensors"] > 0, f"rank {rank}: {report}"


@pytest.fixture(scope="module")
def whole_saves(saved_twice_on_two) -> dict[str, dict]:
    return {save: load_sharded(saved_twice_on_two / save) for save in ("gen-a", "gen-b")}


def flat(checkpoint: dict) -> dict[str, object]:
    values: dict[str, object] = {"step": checkpoint["step"]}
    values.update({f"model.{k}": v for k, v in checkpoint["model"].items()})
    for number, entry in checkpoint["optimizer"]["state"].items():
        values.update({f"state{number}.{k}": v for k, v in entry.items()})
    return values


def equal(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


@pytest.mark.procs
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    saves=st.lists(st.sampled_from(["gen-a", "gen-b"]), min_size=4, max_size=4),
    other_rank=st.lists(st.booleans(), min_size=2, max_size=2),
)
def test_a_folder_assembled_at_random_from_two_saves_is_refused_naming_a_file_or_is_one_save(
    saved_twice_on_two, whole_saves, tmp_path, saves, other_rank
):
    picks = {name: (save, name) for name, save in zip(NAMES, saves)}
    for rank, swap in enumerate(other_rank):
        if swap:  # the other rank's file under this rank's name
            name = f"__{rank}_0.distcp"
            picks[name] = (picks[name][0], f"__{1 - rank}_0.distcp")
    folder = tmp_path / "assembled"
    shutil.rmtree(folder, ignore_errors=True)
    assemble(saved_twice_on_two, folder, picks)
    pure = len(set(saves)) == 1 and not any(other_rank)
    try:
        loaded = load_sharded(folder)
    except CheckpointLoadError as err:
        refusal = str(err)
    else:
        refusal = None
    if refusal is not None:
        assert not pure, f"one save's own files were refused: {refusal}"
        assert any(name in refusal for name in NAMES), f"the refusal names no file: {refusal}"
        return
    got = flat(loaded)
    matches = [save for save, whole in whole_saves.items() if equal(got, flat(whole))]
    assert len(matches) == 1, f"{picks} loaded values of neither save (or of both)"
