"""A job started with MultiprocessingLauncher: `python mp_job.py --outdir D --start-method fork ...`."""

import json
import signal
import sys

# Behave as in a terminal even if started with SIGINT ignored; fabric is imported only after
# use_bare_fabric_package(): hence the late imports (E402)
signal.signal(signal.SIGINT, signal.default_int_handler)

from ranks import parser, rank_body  # noqa: E402
from standin import StandInStrategy, use_bare_fabric_package  # noqa: E402

use_bare_fabric_package()

from fabric.strategies.launchers import MultiprocessingLauncher, RankFailedError  # noqa: E402


def main() -> None:
    opts = parser().parse_args()
    launcher = MultiprocessingLauncher(StandInStrategy(opts.nprocs), start_method=opts.start_method)
    try:
        result = launcher.launch(rank_body, opts)
    except RankFailedError as err:
        print(json.dumps({"rank": err.rank, "exitcode": err.exitcode, "message": str(err)}), flush=True)
        sys.exit(1)
    print(json.dumps({"result": result}), flush=True)


if __name__ == "__main__":
    main()
