"""One error per damage: the same damage to a checkpoint raises the same class on the local disk and on a real S3
server (moto's, on 127.0.0.1, as in ``test_s3.py``), and changes nothing on either.

Each test saves one checkpoint to a folder of this test and one to the bucket, damages both alike (a byte flipped, the
end cut off, bytes appended, a file deleted, another save's file in its place), loads both as a user would and
compares what ``except CheckpointLoadError`` caught: ``CorruptCheckpointError`` each time, naming the checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fabric import Fabric
from fabric._core.urls import filesystem
from fabric.checkpoint.errors import CheckpointLoadError, CorruptCheckpointError
from fabric.checkpoint.formats import load_sharded
from fabric.checkpoint.formats.shard_reader import INDEX_FILE, OBJECTS_FILE, read_index
from fabric.checkpoint.formats.sharded import save_sharded
from fabric.checkpoint.storage import objects as storage
from support.models import stepped_pair

pytestmark = pytest.mark.usefixtures("clean_fabric_env")

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

DATA_FILE = "__0_0.distcp"


@pytest.fixture
def staging(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging folders of a load from the bucket go under this test's temporary folder."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("staging")))


class Bytes:
    """One file of a checkpoint, on the disk or as an object of the bucket (the one its commit record names)."""

    def __init__(self, where: Path | str, name: str | None = None) -> None:
        if isinstance(where, Path):
            self._path: Path | None = where / name if name is not None else where
            return
        self._path = None
        self._fs, path = filesystem(where)
        record = json.loads(self._fs.cat_file(path))
        self._object = f"{storage.generation_prefix(path, record['generation'])}/{name or storage.FILE_OBJECT}"

    def read(self) -> bytes:
        return self._path.read_bytes() if self._path is not None else self._fs.cat_file(self._object)

    def write(self, data: bytes) -> None:
        if self._path is not None:
            self._path.write_bytes(data)
        else:
            self._fs.pipe_file(self._object, data)

    def delete(self) -> None:
        if self._path is not None:
            self._path.unlink()
        else:
            self._fs.rm(self._object)


def flip(at: int) -> Callable[[bytes], bytes]:
    def damage(data: bytes) -> bytes:
        flipped = bytearray(data)
        flipped[at if at >= 0 else len(data) // 2] ^= 0x10
        return bytes(flipped)

    return damage


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "flipped": flip(-1),  # the middle of the file (the data of its largest tensor)
    "truncated": lambda data: data[:-100],
    "grown": lambda data: data + bytes(100),
}


def refusal(load: Callable[[], object]) -> CheckpointLoadError:
    """The error of ``load``, caught by ``except CheckpointLoadError`` as a user's code would."""
    try:
        load()
    except CheckpointLoadError as err:
        return err
    pytest.fail("the damaged checkpoint loaded")


def refused_alike(places: dict[str, Any], load: Callable[[Any, torch.nn.Module], object]) -> None:
    """``load(place, fresh model)`` is refused on the disk and on the bucket with the same class, naming the place,
    and leaves the model as it was."""
    classes = {}
    for kind, place in places.items():
        fresh, _ = stepped_pair(seed=2)
        before = {key: value.clone() for key, value in fresh.state_dict().items()}
        err = refusal(lambda place=place, fresh=fresh: load(place, fresh))
        assert str(place) in str(err), (kind, err)
        assert all(torch.equal(value, fresh.state_dict()[key]) for key, value in before.items()), kind  # nothing changed
        classes[kind] = type(err)
    assert classes["disk"] is classes["s3"] is CorruptCheckpointError, classes


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_single_file_raises_the_same_class_on_disk_and_on_s3(tmp_path: Path, s3_bucket: str, damage: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    net, _ = stepped_pair(seed=1)
    places = {"disk": tmp_path / "ckpt.pt", "s3": f"{s3_bucket}/ckpt.pt"}
    for place in places.values():
        fabric.save(place, {"model": net, "step": 1})
    for file in (Bytes(places["disk"]), Bytes(places["s3"])):
        file.write(DAMAGES[damage](file.read()))
    refused_alike(places, lambda place, fresh: fabric.load(place, {"model": fresh, "step": 0}))


def largest_item_middle(folder: Path) -> int:
    """An offset in the middle of the largest item the index places in the data file: its tensor's bytes."""
    infos = [info for info in read_index(folder).storage_data.values() if info.relative_path == DATA_FILE]
    largest = max(infos, key=lambda info: info.length)
    return largest.offset + largest.length // 2


def damaged_sharded(tmp_path: Path, bucket: str, damage: Callable[[Path, str], None]) -> dict[str, Any]:
    """A sharded checkpoint of the same state in a folder and in the bucket, ``damage(folder, url)`` done to both."""
    net, _ = stepped_pair(seed=1)
    places = {"disk": tmp_path / "sharded", "s3": f"{bucket}/sharded"}
    for place in places.values():
        save_sharded(place, {"model": net, "step": 1})
    damage(places["disk"], places["s3"])
    return places


def alike(change: Callable[[Bytes], None], name: str = DATA_FILE) -> Callable[[Path, str], None]:
    def damage(folder: Path, url: str) -> None:
        change(Bytes(folder, name))
        change(Bytes(url, name))

    return damage


def rewrite(transform: Callable[[bytes], bytes]) -> Callable[[Bytes], None]:
    return lambda file: file.write(transform(file.read()))


@pytest.mark.usefixtures("staging")
@pytest.mark.parametrize(
    "damage",
    ["flipped", "truncated", "grown", "data file deleted", "index deleted", "objects file deleted", "another save's data file"],
)
def test_a_damaged_sharded_checkpoint_raises_the_same_class_on_disk_and_on_s3(tmp_path: Path, s3_bucket: str, damage: str) -> None:
    if damage == "flipped":

        def how(folder: Path, url: str) -> None:
            at = largest_item_middle(folder)  # (the same save, so the same offset in the bucket's copy)
            alike(rewrite(flip(at)))(folder, url)

    elif damage in DAMAGES:
        how = alike(rewrite(DAMAGES[damage]))
    elif damage == "another save's data file":

        def how(folder: Path, url: str) -> None:
            other, _ = stepped_pair(seed=3)  # the same shapes, other values: a file of the same size, another save's
            save_sharded(folder.parent / "other", {"model": other, "step": 1})
            save_sharded(f"{url}-other", {"model": other, "step": 1})
            shutil.copyfile(folder.parent / "other" / DATA_FILE, folder / DATA_FILE)
            Bytes(url, DATA_FILE).write(Bytes(f"{url}-other", DATA_FILE).read())

    else:
        name = {"data file deleted": DATA_FILE, "index deleted": INDEX_FILE, "objects file deleted": OBJECTS_FILE}[damage]
        how = alike(Bytes.delete, name)
    places = damaged_sharded(tmp_path, s3_bucket, how)
    refused_alike(places, lambda place, fresh: load_sharded(place, {"model": fresh, "step": 0}))
