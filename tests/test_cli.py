"""`fabric-torch run`: option parsing and errors (in-process), and real launches (subprocesses).

What the launches must show: the script gets the options through FABRIC_* variables and each rank
the torchrun-style rank variables; one process is the script itself (same pid); the exit status is
the failing rank's own; a failing rank brings the node's job down; a signal to the command ends every
rank, and so does the command being killed outright. Also: the command's names (`fabric-torch`,
`python -m fabric`) and what `--help`/`--version` say, and that those names stay ours when Lightning's
`fabric` command is installed in the same environment.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

import fabric
from fabric import cli, run_options
from fabric.supervision.signals import SHUTDOWN_TIMEOUT_S
from support import PYTHON, REPO
from support.loading import script_path
from support.processes import fabric_run, read_ranks, run, start, wait_dead, wait_for_files

pytestmark = pytest.mark.cold

RANKS_ENV = script_path("multinode", "ranks_env.py")
LINUX = sys.platform.startswith("linux")


def _main(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    out, err = capsys.readouterr()
    return int(info.value.code or 0), out, err


# ---- help and top level ---------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_run_help_lists_every_option_with_lightning_names(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _main(["run", "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: fabric-torch run [options] SCRIPT [SCRIPT_ARGS ...]")
    for flag in ("--accelerator", "--strategy", "--devices", "--num-nodes", "--num_nodes", "--node-rank",
                 "--main-address", "--main-port", "--precision", "--max-restarts", "--shutdown-timeout"):
        assert flag in out
    assert "29400" in out and "127.0.0.1" in out
    assert f"Default: {SHUTDOWN_TIMEOUT_S:g}." in " ".join(out.split())  # the policy's own default


@pytest.mark.timeout(10)
def test_top_level_usage_version_and_unknown_command(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _main([], capsys)
    assert code == 2 and "commands:" in out and "run" in out
    code, out, _ = _main(["--help"], capsys)
    assert code == 0 and "fabric-torch run --help" in out
    code, out, _ = _main(["--version"], capsys)
    assert code == 0 and out.startswith("fabric-torch ")
    code, _, err = _main(["train"], capsys)
    assert code == 2 and "unknown command 'train'" in err and "accepted: run" in err


@pytest.mark.procs
@pytest.mark.timeout(30)
def test_version_and_help_name_the_package_and_its_folder() -> None:
    """`python -m fabric` (and the console scripts, which run the same main) says whose command it is."""
    package = str(REPO / "fabric")
    version = run([PYTHON, "-m", "fabric", "--version"], timeout=25).stdout
    assert version == f"fabric-torch {fabric.__version__} (the fabric package at {package})\n"
    top = run([PYTHON, "-m", "fabric", "--help"], timeout=25).stdout
    assert top.startswith("usage: python -m fabric <command> [options]")
    assert f"The command line of fabric-torch {fabric.__version__} (the fabric package at {package})." in top
    assert "`fabric-torch` or `python -m fabric`" in " ".join(top.split())  # the names that are always ours
    run_help = run([PYTHON, "-m", "fabric", "run", "--help"], timeout=25).stdout
    assert run_help.startswith("usage: python -m fabric run [options] SCRIPT")
    assert f"This is fabric-torch {fabric.__version__} (the fabric package at {package}), not Lightning's launcher." in run_help
    assert "python -m fabric run --accelerator cpu --devices 2 train.py" in run_help  # the examples as called


@pytest.mark.timeout(10)
def test_usage_lines_name_the_command_as_it_was_called() -> None:
    assert cli.program_name("/venv/bin/fabric-torch") == "fabric-torch"
    assert cli.program_name("/venv/bin/fabric") == "fabric"
    assert cli.program_name(str(Path(cli.__file__).parent / "__main__.py")) == "python -m fabric"
    assert cli.program_name("/venv/bin/pytest") == "fabric-torch"  # called as a function: the documented name
    assert cli.program_name("/venv/lib/pytest/__main__.py") == "fabric-torch"  # another package's `python -m`
    assert run_options.PROG == run_options.DISTRIBUTION == "fabric-torch"


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_messages_to_the_ranks_name_the_command_as_it_was_typed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A conflict between an option and the code names `python -m fabric run` or `fabric-torch run`, as typed."""
    script = tmp_path / "conflict.py"
    script.write_text("from fabric import Fabric\nFabric(accelerator='cpu', precision='64-true')\n")
    commands = {"python -m fabric run": fabric_run(), "fabric-torch run": [str(Path(PYTHON).parent / "fabric-torch"), "run"]}
    for typed, command in commands.items():
        result = run([*command, "--precision", "bf16-mixed", str(script)], timeout=40, check=False)
        assert result.returncode == 1, result.stderr
        assert f"--precision=bf16-mixed given to `{typed}`" in result.stderr, result.stderr
        others = [other for other in commands if other != typed]
        assert not any(f"`{other}`" in result.stderr for other in others), result.stderr
    # the refusal of a strategy the command cannot start names the command as typed too
    with pytest.raises(SystemExit):
        run_options.parse_run_args(["--strategy", "ddp_spawn", str(script)], prog="python -m fabric")
    assert "cannot be used with `python -m fabric run`" in capsys.readouterr().err


# A distribution that installs a console script named `fabric`, as `lightning` and `lightning-fabric` do.
_STAND_IN_PYPROJECT = """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "lightning-stand-in"
version = "0.0.1"

[project.scripts]
fabric = "lightning_stand_in:main"

[tool.setuptools]
packages = ["lightning_stand_in"]
"""


@pytest.mark.procs
@pytest.mark.timeout(90)
@pytest.mark.skipif(not LINUX, reason="the virtual environment's layout (bin/) is the POSIX one")
def test_with_lightnings_fabric_command_installed_last_our_names_still_run_ours(tmp_path: Path) -> None:
    """A fresh environment gets this checkout's wheel, then a stand-in for Lightning that installs `fabric`
    (offline: wheels built here, no index). `fabric` is then the stand-in's; `fabric-torch run` and
    `python -m fabric run` still run our launcher (the script sees FABRIC_RUN_BY_CLI, which only ours sets)."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "fabric", source / "fabric", ignore=shutil.ignore_patterns("__pycache__"))
    stand_in = tmp_path / "stand_in"
    (stand_in / "lightning_stand_in").mkdir(parents=True)
    (stand_in / "pyproject.toml").write_text(_STAND_IN_PYPROJECT)
    (stand_in / "lightning_stand_in" / "__init__.py").write_text("def main():\n    print('the stand-in for Lightning')\n")
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    # no PYTHONPATH: with this checkout on it, pip would take the checkout's fabric_torch.egg-info (left by
    # `pip install -e .`) for an installed copy and install nothing
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH" and not name.startswith("FABRIC_")}
    pip = [PYTHON, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source),
         str(stand_in)], timeout=60, env=env, cwd=tmp_path)
    run([PYTHON, "-m", "venv", "--without-pip", str(venv)], timeout=60, env=env, cwd=tmp_path)
    for wheel in ("fabric_torch-*.whl", "lightning_stand_in-*.whl"):  # ours first: Lightning's wins `bin/fabric`
        run([*pip, "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps", "--no-index",
             str(next(wheels.glob(wheel)))], timeout=60, env=env, cwd=tmp_path)

    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    script = tmp_path / "show.py"
    script.write_text("import os\nprint('run by our launcher:', os.environ.get('FABRIC_RUN_BY_CLI'))\n")

    def call(*command: str) -> str:
        return run(list(command), timeout=30, env=env, cwd=tmp_path).stdout

    installed = next((venv / "lib").glob("python*/site-packages/fabric"))
    assert call("fabric-torch", "--version") == f"fabric-torch {fabric.__version__} (the fabric package at {installed})\n"
    assert call("fabric-torch", "run", "--accelerator", "cpu", str(script)) == "run by our launcher: 1\n"
    assert call("python", "-m", "fabric", "run", "--accelerator", "cpu", str(script)) == "run by our launcher: 1\n"
    assert call("fabric", "run", "--accelerator", "cpu", str(script)) == "the stand-in for Lightning\n"


@pytest.mark.procs
@pytest.mark.timeout(40)
def test_fabric_run_starts_ranks_without_importing_torch(tmp_path: Path) -> None:
    """The CLI process of a 2-rank `fabric run` imports no torch (nor numpy, lightning_utilities).

    ``-X importtime`` reports every import of the CLI process itself; the ranks are new interpreters
    without the option, so the report is the CLI's alone.
    """
    command = [PYTHON, "-X", "importtime", "-m", "fabric", "run", "--devices", "2", str(RANKS_ENV), str(tmp_path)]
    result = run(command, timeout=35)
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "fabric.supervision.supervisor" in imported  # the report is complete: the supervisor ran
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "numpy", "lightning_utilities"))
    assert not heavy, heavy
    assert sorted(read_ranks(tmp_path)) == [0, 1]


@pytest.mark.procs
@pytest.mark.timeout(40)
def test_the_core_and_the_environments_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import fabric._core.devices, fabric._core.env, fabric._core.names, fabric._core.processes\n"
        "import fabric.plugins.environments, fabric.strategies, fabric.strategies.launchers\n"
        "heavy = [m for m in ('torch', 'numpy', 'lightning_utilities') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    run([PYTHON, "-c", code], timeout=35)


# ---- bad options: exit status 2, the value and the accepted ones named -------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--accelerator", "tpu"], ["'tpu'", "cpu", "cuda", "mps"]),
        (["--strategy", "deepspeed"], ["'deepspeed'", "ddp", "fsdp"]),
        (["--strategy", "ddp_spawn"], ["'ddp_spawn'", "starts its own processes", "ddp"]),
        (["--strategy", "horovod"], ["'horovod'", "horovodrun"]),
        (["--precision", "8"], ["'8'", "bf16-mixed", "32-true"]),
        (["--devices", "0"], ["'0'", "positive number"]),
        (["--devices", "-2"], ["'-2'", "positive number"]),
        (["--devices", "two"], ["'two'", "'0,1'"]),
        (["--devices", "0,0"], ["'0,0'", "more than once"]),
        (["--accelerator", "cpu", "--devices", "0,1"], ["--devices='0,1'", "--accelerator=cpu", "number of processes"]),
        (["--accelerator", "cpu", "--devices", "-1"], ["--devices='-1'", "--accelerator=cpu"]),
        (["--accelerator", "mps", "--devices", "2"], ["--devices='2'", "one MPS device"]),
        (["--num-nodes", "0"], ["'0'", "number of machines >= 1", "MIN:MAX"]),
        (["--num-nodes", "3:2"], ["'3:2'", "1 <= MIN <= MAX"]),
        (["--num-nodes", "0:2"], ["'0:2'", "1 <= MIN <= MAX"]),
        (["--num-nodes", "1:2:3"], ["'1:2:3'", "MIN:MAX"]),
        (["--num-nodes", "2", "--node-rank", "2"], ["--node-rank=2", "0 .. 1"]),
        (["--num-nodes", "1:2", "--node-rank", "2"], ["--node-rank=2", "--num-nodes=1:2", "0 .. 1"]),
        (["--num-nodes", "1:2", "--rdzv-conf", "last_call=2"], ["'last_call'", "last_call_timeout", "keep_alive_interval"]),
        (["--num-nodes", "1:2", "--rdzv-conf", "last_call_timeout=0"], ["'last_call_timeout=0'", "whole N >= 1"]),
        (["--num-nodes", "2", "--rdzv-conf", "join_timeout=5"], ["--rdzv-conf is not used here", "MIN:MAX"]),
        (["--num-nodes", "1:2", "--rdzv-conf", "keep_alive_max_attempt=2"], ["keep_alive_max_attempt=2", "3 or more"]),
        (["--node-rank", "1"], ["--node-rank=1", "0 .. 0"]),
        (["--main-port", "70000"], ["'70000'", "1..65535"]),
        (["--shutdown-timeout", "-1"], ["--shutdown-timeout='-1'", "seconds >= 0"]),
        (["--shutdown-timeout", "soon"], ["--shutdown-timeout='soon'", "seconds >= 0"]),
        (["--shutdown-timeout", "nan"], ["--shutdown-timeout='nan'", "seconds >= 0"]),
        (["--unknown-flag"], ["unrecognized arguments: --unknown-flag"]),
    ],
)
def test_bad_options_exit_2_naming_value_and_accepted(args: list[str], expected: list[str],
                                                      capsys: pytest.CaptureFixture) -> None:
    code, _, err = _main(["run", *args, str(RANKS_ENV)], capsys)
    assert code == 2
    for text in expected:
        assert text in err, err


@pytest.mark.timeout(10)
def test_missing_or_absent_script_exits_2(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    code, _, err = _main(["run", "--devices", "2"], capsys)
    assert code == 2 and "SCRIPT" in err
    code, _, err = _main(["run", str(tmp_path / "nope.py")], capsys)
    assert code == 2 and "nope.py" in err and "does not exist" in err


@pytest.mark.procs
@pytest.mark.timeout(30)
def test_bad_option_from_the_command_line_exits_2() -> None:
    """Through `python -m fabric`, as a user types it (the console scripts call the same main())."""
    result = run(fabric_run("--accelerator", "tpu", RANKS_ENV), timeout=25, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: python -m fabric run [options] SCRIPT [SCRIPT_ARGS ...]")
    assert "--accelerator='tpu' is not known; accepted: auto, cpu, cuda, gpu, mps" in result.stderr


# ---- what goes to Fabric and what goes to the script --------------------------------------------------


@pytest.mark.timeout(10)
def test_options_before_and_after_script_and_the_double_dash() -> None:
    config = run_options.parse_run_args(["--devices", "2", str(RANKS_ENV), "--lr", "0.1", "--num_nodes=3", "x",
                                 "--help", "--", "--devices", "5"])
    assert config.script == str(RANKS_ENV)
    assert config.devices == "2" and config.num_nodes == 3
    assert config.script_args == ["--lr", "0.1", "x", "--help", "--devices", "5"]
    assert config.given == {"devices", "num_nodes"}
    config = run_options.parse_run_args(["--", str(RANKS_ENV), "-v"])
    assert config.script == str(RANKS_ENV) and config.script_args == ["-v"] and config.given == set()


@pytest.mark.timeout(10)
def test_a_misspelt_option_value_is_answered_with_the_closest_accepted_one(capsys: pytest.CaptureFixture) -> None:
    code, _, err = _main(["run", "--strategy", "fsdp2", str(RANKS_ENV)], capsys)
    assert code == 2 and "--strategy='fsdp2' is not known; accepted: auto, " in err, err
    assert err.rstrip().endswith("; did you mean 'fsdp'?"), err
    code, _, err = _main(["run", "--strategy", "ddp_spwan", str(RANKS_ENV)], capsys)
    assert code == 2 and "did you mean" not in err  # ddp_spawn starts its own processes: never offered to `run`
    code, _, err = _main(["run", "--precision", "bf16mixed", str(RANKS_ENV)], capsys)
    assert code == 2 and err.rstrip().endswith("; did you mean 'bf16-mixed'?"), err
    code, _, err = _main(["run", "--accelerator", "cpus", str(RANKS_ENV)], capsys)
    assert code == 2 and err.rstrip().endswith("accepted: auto, cpu, cuda, gpu, mps; did you mean 'cpu'?"), err


@pytest.mark.timeout(10)
def test_an_option_after_the_script_taken_as_ours_is_said_in_one_line_with_the_way_to_pass_it_on() -> None:
    config = run_options.parse_run_args([str(RANKS_ENV), "--lr", "1", "--strategy", "ddp"], prog="fabric-torch")
    assert config.strategy == "ddp" and config.script_args == ["--lr", "1"]  # as Lightning's CLI takes it
    assert config.taken_after_script == ("--strategy", "ddp")
    note = config.taken_after_script_note()
    assert note is not None and "\n" not in note
    assert note.startswith(f"--strategy ddp, after {RANKS_ENV}, was taken as an option of `fabric-torch run`")
    assert note.endswith(f"write it after '--': fabric-torch run [options] {RANKS_ENV} -- --strategy ddp")
    several = run_options.parse_run_args([str(RANKS_ENV), "--devices=2", "--precision", "bf16-mixed"])
    assert several.taken_after_script == ("--devices=2", "--precision", "bf16-mixed")
    assert "were taken as options of" in (several.taken_after_script_note() or "")
    for argv in (["--devices", "2", str(RANKS_ENV), "--lr", "1"], [str(RANKS_ENV), "--", "--strategy", "ddp"]):
        config = run_options.parse_run_args(argv)
        assert config.taken_after_script == () and config.taken_after_script_note() is None


@pytest.mark.procs
@pytest.mark.timeout(40)
def test_after_a_double_dash_an_option_reaches_the_script_and_before_it_the_user_is_told(tmp_path: Path) -> None:
    taken = run(fabric_run(RANKS_ENV, tmp_path / "taken", "--lr", "1", "--strategy", "ddp"), timeout=35)
    notes = [line for line in taken.stderr.splitlines() if line.startswith("[fabric]")]
    assert len(notes) == 1 and "--strategy ddp, after" in notes[0] and f"{RANKS_ENV} -- --strategy ddp" in notes[0], taken.stderr
    assert read_ranks(tmp_path / "taken")[0]["argv"] == ["--lr", "1"]  # the script never saw it
    passed = run(fabric_run(RANKS_ENV, tmp_path / "passed", "--", "--strategy", "ddp"), timeout=35)
    assert "[fabric]" not in passed.stderr, passed.stderr
    record = read_ranks(tmp_path / "passed")[0]
    assert record["argv"] == ["--strategy", "ddp"] and "FABRIC_STRATEGY" not in record["fabric"]


@pytest.mark.timeout(10)
def test_without_a_script_only_the_script_is_said_to_be_missing(capsys: pytest.CaptureFixture) -> None:
    code, _, err = _main(["run", "--devices", "2"], capsys)
    assert code == 2
    assert err.rstrip().endswith("the following arguments are required: SCRIPT"), err


@pytest.mark.timeout(10)
def test_an_elastic_node_range_and_the_rendezvous_settings() -> None:
    config = run_options.parse_run_args(["--num-nodes", "1:4", "--node-rank", "3", "--rdzv-conf",
                                         "last_call_timeout=2, keep_alive_interval=1", str(RANKS_ENV)])
    assert (config.min_nodes, config.num_nodes, config.elastic, config.node_rendezvous) == (1, 4, True, True)
    assert config.rdzv_conf == {"last_call_timeout": 2, "keep_alive_interval": 1}
    fixed = run_options.parse_run_args(["--num-nodes", "2:2", str(RANKS_ENV)])
    assert (fixed.min_nodes, fixed.num_nodes, fixed.elastic, fixed.node_rendezvous) == (2, 2, False, False)
    restarting = run_options.parse_run_args(["--num-nodes", "2", "--max-restarts", "1", str(RANKS_ENV)])
    assert (restarting.elastic, restarting.node_rendezvous) == (False, True)


@pytest.mark.timeout(10)
def test_defaults_are_lightning_fabric_ones() -> None:
    config = run_options.parse_run_args([str(RANKS_ENV)])
    assert (config.accelerator, config.strategy, config.devices, config.num_nodes, config.node_rank,
            config.main_address, config.precision) == (None, None, "1", 1, 0, "127.0.0.1", None)
    assert run_options.DEFAULT_MAIN_PORT == 29400
    assert config.shutdown_timeout is None  # the supervisor's default (30 s, as torchrun)
    assert run_options.parse_run_args(["--shutdown-timeout", "2.5", str(RANKS_ENV)]).shutdown_timeout == 2.5


@pytest.mark.timeout(10)
def test_processes_per_node_and_fabric_variables() -> None:
    def config(*args: str) -> run_options.RunConfig:
        return run_options.parse_run_args([*args, str(RANKS_ENV)])

    assert cli.processes_per_node(config("--devices", "3")) == 3
    assert cli.processes_per_node(config("--devices", "[0,1]")) == 2
    assert cli.processes_per_node(config("--devices", "4", "--strategy", "dp")) == 1
    assert cli.processes_per_node(config("--accelerator", "cpu", "--devices", "auto")) == 1
    assert cli.processes_per_node(config("--devices", "1,")) == 1  # GPU index 1: one device, not zero
    assert config("--devices", "[3]").devices == "3,"
    # options not given are left to the script; the shape of a job the CLI starts is always passed on
    # every process it starts is marked, so Fabric() sets it up at once (FABRIC_RUN_BY_CLI)
    # and told the command as typed, for its messages (FABRIC_RUN_COMMAND)
    marked = {"FABRIC_RUN_BY_CLI": "1", "FABRIC_RUN_COMMAND": "fabric-torch run"}
    assert cli.fabric_environment(config(), 1) == marked
    assert cli.fabric_environment(config("--precision", "bf16", "--accelerator", "CPU"), 1) == {
        **marked, "FABRIC_PRECISION": "bf16", "FABRIC_ACCELERATOR": "cpu"}
    assert cli.fabric_environment(config("--devices", "2"), 2) == {**marked, "FABRIC_DEVICES": "2"}
    assert cli.fabric_environment(config("--num-nodes", "2"), 1) == {**marked, "FABRIC_DEVICES": "1", "FABRIC_NUM_NODES": "2"}
    from fabric._core.env import rank_environment

    env = rank_environment("127.0.0.1", 1234, node_rank=2, num_nodes=3, processes_per_node=2, local_rank=1)
    assert env["RANK"] == "5" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "6"
    assert env["GROUP_RANK"] == env["NODE_RANK"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "1234"


@pytest.mark.timeout(60)
def test_choices_come_from_the_registries() -> None:
    from fabric.accelerators import ACCELERATOR_REGISTRY
    from fabric.plugins.precision import PRECISION_ALIASES, PRECISION_VALUES
    from fabric.strategies import STRATEGY_REGISTRY, strategy_launch

    assert set(run_options.ACCELERATORS) == {"auto", "gpu", *ACCELERATOR_REGISTRY}
    assert set(run_options.PRECISIONS) == {*PRECISION_VALUES, *(str(a) for a in PRECISION_ALIASES)}
    accepted, refused = run_options._strategies()
    assert set(accepted) | set(refused) == {"auto", *STRATEGY_REGISTRY} and not set(accepted) & set(refused)
    assert "ddp" in accepted and not any("spawn" in name or "fork" in name for name in accepted)
    assert "horovodrun" in refused["horovod"]
    assert strategy_launch("ddp_spawn") == strategy_launch("ddp_notebook") == "from_function"
    assert strategy_launch("dp") == strategy_launch("single_device") == "one_per_node"
    assert strategy_launch("ddp") == "per_device"


# ---- real launches -------------------------------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(40)
def test_one_process_becomes_the_script_with_options_in_fabric_variables(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(
        "import json, os, sys\n"
        "from fabric import Fabric\n"
        "f = Fabric()\n"
        "print(json.dumps({'pid': os.getpid(), 'argv': sys.argv[1:], 'rank': os.environ.get('RANK'),\n"
        "  'precision': f.strategy.precision.precision, 'device': str(f.device), 'world': f.world_size,\n"
        "  'fabric': {k: v for k, v in os.environ.items() if k.startswith('FABRIC_')}}))\n"
        "sys.exit(3)\n"
    )
    proc = start(fabric_run("--accelerator", "cpu", "--precision", "bf16-mixed", script, "a", "--b", "c"))
    out, err = proc.communicate(timeout=35)
    assert proc.returncode == 3, err  # the script's exit status is the command's
    shown = json.loads(out.strip().splitlines()[-1])
    assert shown["pid"] == proc.pid  # no extra process in between
    assert shown["argv"] == ["a", "--b", "c"]
    assert shown["rank"] is None and shown["world"] == 1
    assert shown["fabric"] == {"FABRIC_ACCELERATOR": "cpu", "FABRIC_PRECISION": "bf16-mixed", "FABRIC_RUN_BY_CLI": "1",
                               "FABRIC_RUN_COMMAND": "python -m fabric run"}
    assert shown["precision"] == "bf16-mixed" and shown["device"] == "cpu"


@pytest.mark.procs
@pytest.mark.timeout(40)
def test_two_processes_get_rank_variables(tmp_path: Path) -> None:
    result = run(fabric_run("--devices", "2", RANKS_ENV, tmp_path, "--lr", "1"), timeout=35)
    assert result.returncode == 0
    ranks = read_ranks(tmp_path)
    assert sorted(ranks) == [0, 1]
    for rank, record in ranks.items():
        env = record["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["NODE_RANK"], env["GROUP_RANK"]) == ("2", "2", "0", "0")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == ranks[0]["env"]["MASTER_PORT"]
        assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
        # the supervisor's own variables: its pid (the rank follows it) and the job folder
        assert record["fabric"].pop("FABRIC_PARENT_PID").isdigit()
        assert "fabric-job-" in record["fabric"].pop("FABRIC_JOB_DIR")
        record["fabric"].pop("FABRIC_STATUS_FD", None)  # taken out of the environment once Fabric runs
        assert record["fabric"] == {"FABRIC_DEVICES": "2", "FABRIC_RUN_BY_CLI": "1", "FABRIC_RUN_COMMAND": "python -m fabric run"}
        assert record["argv"] == ["--lr", "1"]


@pytest.mark.procs
@pytest.mark.timeout(40)
def test_a_failing_rank_ends_the_job_with_its_exit_status(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run(fabric_run("--devices", "3", RANKS_ENV, tmp_path, "--exit-code-on-rank", "1", "5", "--sleep", "60"),
                 timeout=35, check=False)
    took = time.monotonic() - started
    assert result.returncode == 5, result.stderr
    assert "[fabric] rank 1 exited with code 5, pid" in result.stderr
    assert "stopping the other 2 rank(s)" in result.stderr
    assert took < 30  # the sleeping ranks (60 s) were stopped
    wait_dead([r["pid"] for r in read_ranks(tmp_path).values()], timeout=5)


# A Fabric script whose rank 1 fails in the way named by argv[1]; rank 0 sleeps meanwhile (stopped by the job).
_FAILING_RANK = """\
import os, signal, sys, time
from fabric import Fabric
fabric = Fabric(accelerator="cpu")
fabric.launch()
if fabric.global_rank == 1:
    how = sys.argv[1]
    if how == "raise":
        raise ValueError("boom from rank 1")
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
time.sleep(60)
"""


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "status", "said"),
    [
        ("raise", 1, "rank 1 raised ValueError, pid"),
        ("exit", 3, "rank 1 exited with code 3, pid"),
        ("sigkill", 128 + signal.SIGKILL, "rank 1 was killed by SIGKILL, pid"),
    ],
)
def test_the_job_ends_with_the_failing_ranks_own_status_and_counts_the_others(
    tmp_path: Path, how: str, status: int, said: str
) -> None:
    """A rank that raises makes the job exit 1, not the 143 of the SIGTERM that stopped it while it unwound;
    the report counts the ranks stopped besides it (1 in a 2-rank job)."""
    script = tmp_path / "fail.py"
    script.write_text(_FAILING_RANK)
    result = run(fabric_run("--devices", "2", script, how), timeout=50, check=False)
    assert result.returncode == status, result.stderr
    reports = [line for line in result.stderr.splitlines() if line.startswith("[fabric]")]
    assert len(reports) == 1 and said in reports[0], result.stderr
    assert reports[0].endswith("; stopping the other 1 rank(s) on this node"), result.stderr


@pytest.mark.procs
@pytest.mark.timeout(40)
def test_waiting_for_a_slow_rank_costs_no_cpu(tmp_path: Path) -> None:
    """Rank 1 ends at once, rank 0 after 5 s: `fabric run` must sleep meanwhile, not spin."""
    proc = start(fabric_run("--devices", "2", RANKS_ENV, tmp_path, "--exit-code-on-rank", "1", "0", "--sleep", "5"))
    _, status, usage = os.wait4(proc.pid, 0)  # resources of the CLI and the ranks it waited for
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    assert usage.ru_utime + usage.ru_stime < 3.5  # importing fabric is most of it; a busy wait adds ~5 s


@pytest.mark.procs
@pytest.mark.timeout(40)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_cli_stops_every_rank(tmp_path: Path, signum: int) -> None:
    proc = start(fabric_run("--devices", "2", RANKS_ENV, tmp_path, "--sleep", "60"))
    try:
        wait_for_files(tmp_path, "rank*.json", 2, timeout=30)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum
    assert f"received {signal.Signals(signum).name}" in err
    wait_dead([r["pid"] for r in read_ranks(tmp_path).values()], timeout=5)


@pytest.mark.procs
@pytest.mark.timeout(40)
@pytest.mark.skipif(not LINUX, reason="parent-death signals are a Linux feature")
def test_ranks_die_when_the_cli_is_killed_outright(tmp_path: Path) -> None:
    proc = start(fabric_run("--devices", "2", RANKS_ENV, tmp_path, "--sleep", "60"))
    try:
        wait_for_files(tmp_path, "rank*.json", 2, timeout=30)
        proc.kill()  # SIGKILL: no chance to clean up
        proc.communicate(timeout=10)
    finally:
        proc.kill()
    wait_dead([r["pid"] for r in read_ranks(tmp_path).values()], timeout=5)
