"""A job started with SubprocessScriptLauncher: `python popen_job.py --outdir D ...`.

Also runnable as `python -m support.scripts.launchers.popen_job` from the tests directory.
"""

import os
import signal
import sys

# Behave as in a terminal even if the test runner started us with SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

if __package__:
    from .ranks import parser, rank_body
    from .standin import StandInEnvironment, use_bare_fabric_package
else:
    from ranks import parser, rank_body
    from standin import StandInEnvironment, use_bare_fabric_package

use_bare_fabric_package()

from fabric.strategies.launchers import SubprocessScriptLauncher  # noqa: E402 - only after use_bare_fabric_package()


def main() -> None:
    argv = sys.argv[1:]
    strategy_kills = "--strategy-kills" in argv  # behave like a strategy's on_exception
    opts = parser().parse_args([a for a in argv if a != "--strategy-kills"])
    launcher = SubprocessScriptLauncher(StandInEnvironment(), num_processes=opts.nprocs, num_nodes=1)
    try:
        result = launcher.launch(rank_body, opts)
    except Exception:
        if strategy_kills:
            launcher.kill()
            print(f"killed {len(launcher.procs)} children", flush=True)
        raise
    # One write per line: under PYTHONUNBUFFERED print writes the text and the newline apart, and the
    # ranks share this pipe, so their lines could interleave.
    os.write(1, f"rank {result['rank']} returned\n".encode())


if __name__ == "__main__":
    main()
