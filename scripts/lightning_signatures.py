"""Write the public members of Lightning Fabric's ``Fabric`` (names, kinds, parameters, defaults) to a JSON file.

``tests/test_dropin.py`` compares our ``Fabric`` with that file, so Lightning never becomes a dependency of
the project. To regenerate it (e.g. for a new Lightning release), in a scratch environment outside the project:

    python3 -m venv /tmp/lf && /tmp/lf/bin/pip install torch==2.13.0 lightning-fabric==2.6.6
    /tmp/lf/bin/python scripts/lightning_signatures.py

It writes ``tests/support/lightning_fabric_<version>_signatures.json`` (dots as underscores); point
``LIGHTNING_SIGNATURES`` in ``tests/test_dropin.py`` at a new file to compare with another release.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def main() -> None:
    sys.path.insert(0, str(TESTS))
    import lightning_fabric
    import torch
    from lightning_fabric import Fabric

    from support.public_members import describe

    version = lightning_fabric.__version__
    record = {
        "package": "lightning-fabric",
        "version": version,
        "torch": torch.__version__,
        "class": "lightning_fabric.Fabric",
        "members": describe(Fabric),
    }
    target = TESTS / "support" / f"lightning_fabric_{version.replace('.', '_')}_signatures.json"
    target.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {len(record['members'])} members of lightning_fabric.Fabric {version} to {target}")


if __name__ == "__main__":
    main()
