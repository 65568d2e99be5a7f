"""``fabric-torch consolidate CHECKPOINT_DIR OUT.pt``: turn a sharded checkpoint folder into one file.

Runs in this one process, without starting a job: every tensor is read whole from its shards. The
result is what ``state_dict_type="full"`` writes: plain ``torch.load`` reads it (safely, with
``weights_only=True``), optimizer states are in ``Optimizer.state_dict()``'s numbered form, and the
non-tensor entries (step counters, loader states, ...) are kept. The file is written atomically.

Either side may be a URL (``s3://bucket/run/ckpt``, any fsspec store): a sharded checkpoint saved there is
read through its commit record (every object checked against it, fetched into a local staging folder that
is removed afterwards), and a file written there is committed the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

PROG = "fabric-torch consolidate"


def consolidate(checkpoint_dir: str | Path, out: str | Path, weights_only: bool | None = None) -> dict:
    """Read the sharded checkpoint ``checkpoint_dir`` whole and write it to the file ``out``; return it."""
    from fabric.checkpoint.formats import Load, choose
    from fabric.checkpoint.formats.file import save_file
    from fabric.checkpoint.storage import locate

    # a URL (s3://...) names a store, checked here (unknown scheme, missing library) before anything is read
    source, target = locate(checkpoint_dir), locate(out, writing="write OUT.pt")
    found = source.detect()
    if found.kind != "folder":
        what = "does not exist" if found.kind == "missing" else "is not a sharded checkpoint folder"
        raise ValueError(f"{source.shown!r} {what}; {PROG} takes a folder written by a sharded save")
    if target.is_folder() or os.path.realpath(target.shown) == os.path.realpath(source.shown):
        raise ValueError(f"OUT.pt {target.shown!r} must be a file path, not the checkpoint folder or another folder")
    source.adopt(found)
    checkpoint = choose(found, source).load(Load(source, None, weights_only=weights_only))  # (a folder no format claims: refused)
    save_file(target, checkpoint)
    return checkpoint


def main(argv: Sequence[str], prog: str = PROG) -> int:
    """``prog``: the command as the user called it (``fabric-torch consolidate``, ``python -m fabric consolidate``)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="folder (or URL) written by a sharded save")
    parser.add_argument("out", metavar="OUT.pt", help="the single file to write (a path or a URL)")
    parser.add_argument(
        "--unsafe-load",
        action="store_true",
        help="allow pickled objects in the checkpoint's non-tensor part (only for files you trust)",
    )
    args = parser.parse_args(list(argv))
    try:
        checkpoint = consolidate(args.checkpoint_dir, args.out, weights_only=False if args.unsafe_load else None)
    except (ValueError, OSError, RuntimeError, ImportError) as err:  # ImportError: a URL's storage library is missing
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    from fabric.checkpoint.storage import locate

    print(f"{prog}: wrote {locate(args.out).shown} ({', '.join(sorted(map(str, checkpoint)))})")
    return 0
