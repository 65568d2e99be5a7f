"""``fabric-torch run``'s command line: its options, their checks, and the :class:`RunConfig` they make.

Every value a user can get wrong is checked here, before anything starts, with a message naming the
value and what is accepted. The flag spellings are Lightning Fabric's. Standard library and the
torch-free ``fabric._core`` only (``fabric run`` must not import torch before the ranks start).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fabric._core.devices import DevicesSyntaxError, parse_devices
from fabric._core.env import LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS_ENV, REPLICA_GROUP_ENV
from fabric._core.names import ACCELERATOR_CHOICES, PRECISION_ALIASES, PRECISION_VALUES
from fabric._core.suggestions import did_you_mean
from fabric._core.urls import is_url, redact

__all__ = [
    "DEFAULT_MAIN_ADDRESS", "DEFAULT_MAIN_PORT", "DISTRIBUTION", "PROG", "RunConfig", "build_run_parser", "lighthouse_url",
    "parse_run_args",
]

#: The distribution's name. Its console script of that name is ours alone: Lightning (`lightning`,
#: `lightning-fabric`) installs a `fabric` command too, and whichever package was installed last owns it.
DISTRIBUTION = "fabric-torch"
#: The command the docs, messages and help show (also `python -m fabric`).
PROG = DISTRIBUTION
# `fabric run` hands these to the script's Fabric(); its choices are the core's names (no torch import).
ACCELERATORS = ACCELERATOR_CHOICES
PRECISIONS = (*PRECISION_VALUES, *(alias for alias in PRECISION_ALIASES if isinstance(alias, str)))
# Why a strategy cannot be started by `fabric run`, by how its processes come to exist.
_REFUSED = {
    "from_function": "it starts its own processes from inside the script",
    "horovodrun": "Horovod jobs are started by horovodrun: `horovodrun -np N python SCRIPT`",
}

DEFAULT_MAIN_ADDRESS = "127.0.0.1"
DEFAULT_MAIN_PORT = 29400


def _strategies() -> tuple[tuple[str, ...], dict[str, str]]:
    """The strategy names the CLI accepts, and why each of the others is refused (from the registry)."""
    from fabric.strategies import STRATEGY_REGISTRY, strategy_launch  # the registry imports nothing heavy

    refused = {name: _REFUSED[strategy_launch(name)] for name in STRATEGY_REGISTRY if strategy_launch(name) in _REFUSED}
    return ("auto", *(name for name in STRATEGY_REGISTRY if name not in refused)), refused


def _choice(option: str, accepted: Sequence[str], extra: dict[str, str] | None = None, prog: str = PROG) -> Any:
    def parse(value: str) -> str:
        if value.lower() in accepted:
            return value.lower()
        if extra and value.lower() in extra:
            raise argparse.ArgumentTypeError(
                f"{option}={value!r} cannot be used with `{prog} run`: {extra[value.lower()]}."
                f" Accepted: {', '.join(accepted)}"
            )
        raise argparse.ArgumentTypeError(
            f"{option}={value!r} is not known; accepted: {', '.join(accepted)}{did_you_mean(value, accepted)}"
        )

    return parse


def _devices(value: str) -> str:
    """Check ``--devices`` with the core's device syntax; pass it on as text the connector reads back."""
    text = value.strip()
    try:
        parsed = parse_devices(text)
    except DevicesSyntaxError:
        raise argparse.ArgumentTypeError(
            f"--devices={value!r} is not valid; accepted: a positive number of devices per node (e.g. 2),"
            " -1 or 'auto' (every GPU), or device indices such as '0,1'"
        ) from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"--devices={value!r} names a device more than once") from None
    if parsed == "all":
        return text
    if isinstance(parsed, int):
        return str(parsed)
    # a single index keeps its comma ("0,": device 0, not a count of 0 devices)
    return ",".join(map(str, parsed)) + ("," if len(parsed) == 1 else "")


def _non_negative_int(option: str) -> Any:
    def parse(value: str) -> int:
        if value.strip().isdigit():
            return int(value)
        raise argparse.ArgumentTypeError(f"{option}={value!r} is not valid; accepted: an integer >= 0")

    return parse


def _node_count(value: str) -> tuple[int, int]:
    """``--num-nodes``: ``N`` (exactly N machines) or ``MIN:MAX`` (torchrun's elastic range), as (min, max)."""
    parts = value.strip().split(":")
    if len(parts) in (1, 2) and all(part.strip().isdigit() for part in parts):
        low, high = int(parts[0]), int(parts[-1])
        if 1 <= low <= high:
            return low, high
    raise argparse.ArgumentTypeError(
        f"--num-nodes={value!r} is not valid; accepted: a number of machines >= 1, or a range MIN:MAX with 1 <= MIN <= MAX"
    )


#: What ``--rdzv-conf`` may set: torch's dynamic rendezvous settings, whole seconds (or attempts), as torchrun takes them.
RDZV_CONF_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval", "keep_alive_max_attempt")


def _rdzv_conf(value: str) -> dict[str, int]:
    """``--rdzv-conf KEY=VALUE,...``: settings of the nodes' rendezvous (torchrun's spelling and meaning)."""
    conf: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, _, number = item.partition("=")
        key = key.strip()
        if key not in RDZV_CONF_KEYS:
            raise argparse.ArgumentTypeError(f"--rdzv-conf: {key!r} is not a setting; accepted: {', '.join(RDZV_CONF_KEYS)}")
        if not number.strip().isdigit() or int(number) < 1:
            raise argparse.ArgumentTypeError(f"--rdzv-conf: {item!r} is not valid; accepted: {key}=N with a whole N >= 1")
        conf[key] = int(number)
    if conf.get("keep_alive_max_attempt", 3) < 3:
        # torch sends a heartbeat only once the last one is a whole interval old: every one to two intervals
        raise argparse.ArgumentTypeError(
            f"--rdzv-conf: keep_alive_max_attempt={conf['keep_alive_max_attempt']} would take live nodes for gone"
            " (a node's heartbeat comes every one to two keep_alive_interval); accepted: 3 or more"
        )
    if not conf:
        raise argparse.ArgumentTypeError(f"--rdzv-conf={value!r} sets nothing; accepted: KEY=N[,KEY=N] with KEY one of {', '.join(RDZV_CONF_KEYS)}")
    return conf


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if 0 <= seconds < float("inf"):  # NaN too is refused
        return seconds
    raise argparse.ArgumentTypeError(f"--shutdown-timeout={value!r} is not valid; accepted: a number of seconds >= 0")


def _port(value: str) -> int:
    if value.strip().isdigit() and 1 <= int(value) <= 65535:
        return int(value)
    raise argparse.ArgumentTypeError(f"--main-port={value!r} is not valid; accepted: an integer in 1..65535")


def _positive_int(option: str) -> Any:
    def parse(value: str) -> int:
        if value.strip().isascii() and value.strip().isdigit() and int(value) >= 1:
            return int(value)
        raise argparse.ArgumentTypeError(f"{option}={value!r} is not valid; accepted: an integer >= 1")

    return parse


def lighthouse_url(value: str) -> str:
    """``--lighthouse``: ``HOST:PORT`` or ``http://HOST:PORT`` (an IPv6 host in brackets), as ``http://HOST:PORT``.

    Raises ``ValueError`` naming the value and what is accepted.
    """
    accepted = "accepted: HOST:PORT or http://HOST:PORT (an IPv6 address in brackets: [::1]:29510), PORT in 1..65535"
    text = value.strip()
    scheme, separator, rest = text.partition("://")
    if separator:
        rest = rest[:-1] if rest.endswith("/") else rest  # http://HOST:PORT/ is the same place
    else:
        scheme, rest = "http", text
    host, colon, port = rest.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
    plain = bool(host) and not any(char in host for char in "[]:")
    if (
        scheme.lower() != "http"
        or not colon
        or not (bracketed or plain)
        or any(char in rest for char in "/?#@ \t")
        or not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535)
    ):
        raise ValueError(f"--lighthouse={value!r} is not valid; {accepted}")
    return f"http://{host}:{int(port)}"


def _lighthouse(value: str) -> str:
    try:
        return lighthouse_url(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# (dest, flags, argparse keyword arguments); the flag spellings are Lightning Fabric's.
def _options(prog: str = PROG) -> list[tuple[str, tuple[str, ...], dict[str, Any]]]:
    strategies, refused = _strategies()
    return [
        ("accelerator", ("--accelerator",), dict(
            type=_choice("--accelerator", ACCELERATORS), default=None, metavar="NAME",
            help=f"The hardware to run on: {', '.join(ACCELERATORS)}. Default: the script's choice ('auto')."),
        ),
        ("strategy", ("--strategy",), dict(
            type=_choice("--strategy", strategies, refused, prog), default=None, metavar="NAME",
            help=f"How to run across devices: {', '.join(strategies)}. Default: the script's choice ('auto')."),
        ),
        ("devices", ("--devices",), dict(
            type=_devices, default="1", metavar="N",
            help="Devices (processes) per node: a number, -1 or 'auto' (every GPU), or indices like '0,1'."
            " Default: 1."),
        ),
        ("num_nodes", ("--num-nodes", "--num_nodes"), dict(
            type=_node_count, default=(1, 1), metavar="N|MIN:MAX",
            help="Number of machines (nodes) in the job, or a range MIN:MAX (elastic: with --max-restarts, the job"
            " goes on with the nodes left after one is lost, at least MIN, and takes up to MAX). Default: 1."),
        ),
        ("node_rank", ("--node-rank", "--node_rank"), dict(
            type=_non_negative_int("--node-rank"), default=0, metavar="R",
            help="Index of this machine, 0 .. num_nodes-1 (run the command once per machine); with MIN:MAX nodes it"
            " orders the machines and 0 marks the one at --main-address. Default: 0."),
        ),
        ("main_address", ("--main-address", "--main_address"), dict(
            default=DEFAULT_MAIN_ADDRESS, metavar="HOST",
            help="Address of the machine with node rank 0, reachable from all nodes."
            f" Default: {DEFAULT_MAIN_ADDRESS}."),
        ),
        ("main_port", ("--main-port", "--main_port"), dict(
            type=_port, default=None, metavar="PORT",
            help=f"Port on the main machine for the rendezvous (of the nodes, with --max-restarts). Default:"
            f" {DEFAULT_MAIN_PORT} (on a single node, a free port)."),
        ),
        ("max_restarts", ("--max-restarts", "--max_restarts"), dict(
            type=_non_negative_int("--max-restarts"), default=0, metavar="N",
            help="After a rank fails, stop the ranks and start them again, up to N times; every attempt sees"
            " TORCHELASTIC_RESTART_COUNT (0, 1, ...). Several nodes restart together. Default: 0."),
        ),
        ("rdzv_id", ("--rdzv-id", "--rdzv_id"), dict(
            default=None, metavar="ID",
            help="With --max-restarts and several nodes: the job's id in the nodes' rendezvous, the same on"
            " every node. Default: derived from --main-address and --main-port."),
        ),
        ("rdzv_conf", ("--rdzv-conf", "--rdzv_conf"), dict(
            type=_rdzv_conf, default=None, metavar="KEY=N,...",
            help="Settings of the nodes' rendezvous, as torchrun's: join_timeout (600 s), last_call_timeout (how long"
            " to wait for more nodes once MIN have joined; 30 s), close_timeout (30 s), keep_alive_interval (5 s)"
            " and keep_alive_max_attempt (3: a node silent for 3 x 5 s is gone)."),
        ),
        ("shutdown_timeout", ("--shutdown-timeout", "--shutdown_timeout"), dict(
            type=_seconds, default=None, metavar="S",
            help="After SIGTERM, passed on to the ranks, wait up to S seconds for them to end before they are"
            " killed (torchrun's option). Default: 30."),
        ),
        ("precision", ("--precision",), dict(
            type=_choice("--precision", PRECISIONS), default=None, metavar="P",
            help=f"Numeric precision: {', '.join(PRECISIONS)}. Default: the script's choice ('32-true')."),
        ),
        # fault tolerance across replica groups (the ddp_ft strategy): the three go together
        ("replica_group", ("--replica-group", "--replica_group"), dict(
            type=_non_negative_int("--replica-group"), default=None, metavar="G",
            help="For the ddp_ft strategy: this job is replica group G (0 .. R-1) of --num-replica-groups R, which"
            " find each other at --lighthouse; each group is its own run (its ranks, main port and restarts)."
            f" The ranks get {REPLICA_GROUP_ENV}=G. Give all three or none."),
        ),
        ("num_replica_groups", ("--num-replica-groups", "--num_replica_groups"), dict(
            type=_positive_int("--num-replica-groups"), default=None, metavar="R",
            help=f"For the ddp_ft strategy: how many replica groups train together. The ranks get {NUM_REPLICA_GROUPS_ENV}=R."),
        ),
        ("lighthouse", ("--lighthouse",), dict(
            type=_lighthouse, default=None, metavar="HOST:PORT",
            help=f"For the ddp_ft strategy: the address of `{prog} lighthouse` (HOST:PORT or http://HOST:PORT)."
            f" The ranks get {LIGHTHOUSE_ENV}=http://HOST:PORT."),
        ),
    ]


_EPILOG = """\
Fabric's options may come before or after SCRIPT; everything else after SCRIPT goes to the script
(--help too). Put '--' before script arguments that look like Fabric's options.
The options reach `Fabric()` in the script through FABRIC_* environment variables, so the script
needs no flags of its own; options not given are left to the script's code.

examples:
  {prog} run train.py                                   # like `python train.py`
  {prog} run --accelerator cpu --devices 2 train.py --lr 0.1
  {prog} run --devices 2 --num-nodes 2 --node-rank 0 --main-address 10.0.0.1 train.py   # machine 0
  {prog} run --devices 2 --num-nodes 2 --node-rank 1 --main-address 10.0.0.1 train.py   # machine 1
"""


def build_run_parser(prog: str = PROG, about: str = "") -> argparse.ArgumentParser:
    """The parser of ``fabric-torch run`` (also what ``--help`` prints), ``prog`` being the command as called.

    ``about`` (which package this command belongs to) is added to the description.
    """
    description = "Run a Python script that uses Fabric on the given devices and machines."
    parser = argparse.ArgumentParser(
        prog=f"{prog} run",
        usage=f"{prog} run [options] SCRIPT [SCRIPT_ARGS ...]",
        description=f"{description}\n{about}" if about else description,
        epilog=_EPILOG.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("script", metavar="SCRIPT", help="The Python script to run.")
    # a default makes argparse treat the optional list as optional in its "required" message too
    parser.add_argument("script_args", metavar="SCRIPT_ARGS", nargs="*", default=[], help="Arguments for the script.")
    for dest, flags, kwargs in _options(prog):
        parser.add_argument(*flags, dest=dest, **kwargs)
    return parser


def _split_argv(argv: Sequence[str], flags: set[str]) -> tuple[list[str], str | None, list[str], list[str]]:
    """Separate Fabric's options from SCRIPT and the script's own arguments.

    Like Lightning's CLI, Fabric's options are recognised before and after SCRIPT; unknown options
    after SCRIPT belong to the script (``--help`` too), and '--' ends Fabric's options. The fourth list:
    the tokens of Fabric's options that came after SCRIPT (the user is told, see ``RunConfig.taken_after_script``).
    """
    ours: list[str] = []
    script: str | None = None
    rest: list[str] = []
    after: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            tail = tokens[i + 1 :]
            if script is None and tail:
                script, tail = tail[0], tail[1:]
            rest.extend(tail)
            break
        name = token.split("=", 1)[0]
        if token in ("-h", "--help") and script is None:
            ours.append(token)  # after SCRIPT, --help is the script's
        elif name in flags:
            taken = [token] if "=" in token or i + 1 == len(tokens) else [token, tokens[i + 1]]
            ours.extend(taken)
            if script is not None:
                after.extend(taken)
            i += len(taken) - 1
        elif script is None and token.startswith("-") and token != "-":
            ours.append(token)  # an unknown option before SCRIPT: let argparse report it
        elif script is None:
            script = token
        else:
            rest.append(token)
        i += 1
    return ours, script, rest, after


@dataclass
class RunConfig:
    """The checked options of one ``fabric run``."""

    script: str
    script_args: list[str]
    accelerator: str | None
    strategy: str | None
    devices: str
    num_nodes: int  # the most machines the job runs on (MAX of MIN:MAX)
    node_rank: int
    main_address: str
    main_port: int | None
    precision: str | None
    given: frozenset[str]  # the options the user wrote
    max_restarts: int = 0
    rdzv_id: str | None = None
    shutdown_timeout: float | None = None  # None: the supervisor's default
    min_nodes: int | None = None  # the fewest machines it goes on with (MIN of MIN:MAX); None: num_nodes
    rdzv_conf: dict[str, int] | None = None  # --rdzv-conf
    prog: str = PROG  # the command as the user typed it (`fabric-torch`, `fabric`, `python -m fabric`)
    # --replica-group, --num-replica-groups, --lighthouse (as http://HOST:PORT): all three or none
    replica_group: int | None = None
    num_replica_groups: int | None = None
    lighthouse: str | None = None
    #: Fabric's options given after SCRIPT, taken as this command's own (as Lightning's does), e.g. ("--strategy", "ddp")
    taken_after_script: tuple[str, ...] = ()

    def taken_after_script_note(self) -> str | None:
        """One line telling that options after SCRIPT were taken as this command's, and how to hand them to the script."""
        if not self.taken_after_script:
            return None
        given = " ".join(self.taken_after_script)
        one = sum(token.startswith("-") for token in self.taken_after_script) == 1
        taken, it = ("was taken as an option", "it") if one else ("were taken as options", "them")
        return (
            f"{given}, after {self.script}, {taken} of `{self.prog} run` (as Lightning's CLI does); to pass {it} to"
            f" the script instead, write {it} after '--': {self.prog} run [options] {self.script} -- {given}"
        )

    @property
    def elastic(self) -> bool:
        """Whether the number of machines may change between attempts (``--num-nodes MIN:MAX``)."""
        return self.min_nodes is not None and self.min_nodes < self.num_nodes

    @property
    def node_rendezvous(self) -> bool:
        """Whether the nodes meet in torch's elastic rendezvous: they restart together, or their number varies."""
        return self.num_nodes > 1 and (self.max_restarts > 0 or self.elastic)


def parse_run_args(argv: Sequence[str], prog: str = PROG, about: str = "") -> RunConfig:
    """Parse and check ``fabric-torch run`` arguments; exits with status 2 and a message naming the bad value."""
    parser = build_run_parser(prog, about)
    flag_to_dest = {flag: dest for dest, flags, _ in _options() for flag in flags}
    ours, script, rest, after = _split_argv(argv, set(flag_to_dest))
    args = parser.parse_args([*ours, "--", script] if script is not None else ours)
    given = frozenset(flag_to_dest[token.split("=", 1)[0]] for token in ours if token.split("=", 1)[0] in flag_to_dest)
    min_nodes, num_nodes = args.num_nodes
    nodes_given = str(num_nodes) if min_nodes == num_nodes else f"{min_nodes}:{num_nodes}"
    if args.node_rank >= num_nodes:
        parser.error(f"--node-rank={args.node_rank} is not valid with --num-nodes={nodes_given}; accepted: 0 .. {num_nodes - 1}")
    rendezvous = num_nodes > 1 and (args.max_restarts > 0 or min_nodes < num_nodes)
    if args.rdzv_id is not None and not (rendezvous and args.rdzv_id.strip()):
        parser.error(
            f"--rdzv-id={args.rdzv_id!r} is not used here; accepted: a non-empty id, with --num-nodes > 1 and"
            " --max-restarts >= 1, or --num-nodes MIN:MAX (the nodes' rendezvous exists only then)"
        )
    if args.rdzv_conf is not None and not rendezvous:
        parser.error(
            "--rdzv-conf is not used here; accepted with --num-nodes > 1 and --max-restarts >= 1, or --num-nodes MIN:MAX"
            " (the nodes' rendezvous exists only then)"
        )
    replica_flags = {"replica_group": "--replica-group", "num_replica_groups": "--num-replica-groups", "lighthouse": "--lighthouse"}
    missing = [flag for dest, flag in replica_flags.items() if getattr(args, dest) is None]
    if 0 < len(missing) < len(replica_flags):
        present = [flag for flag in replica_flags.values() if flag not in missing]
        parser.error(
            f"{' and '.join(present)} given without {' and '.join(missing)}; accepted: all three of --replica-group G,"
            " --num-replica-groups R and --lighthouse HOST:PORT (this job is replica group G of R, which meet at the"
            " lighthouse), or none of them"
        )
    if not missing and args.replica_group >= args.num_replica_groups:
        parser.error(
            f"--replica-group={args.replica_group} is not valid with --num-replica-groups={args.num_replica_groups};"
            f" accepted: 0 .. {args.num_replica_groups - 1}"
        )
    if is_url(args.script):  # never looked up as a local path named "s3:/..."
        parser.error(f"SCRIPT {redact(args.script)!r} is a URL; accepted: the path of a local Python script")
    if not os.path.isfile(args.script):
        parser.error(f"SCRIPT {args.script!r} does not exist (or is not a file)")
    if not args.main_address.strip():
        parser.error("--main-address='' is empty; accepted: a host name or IP address")
    if args.accelerator == "cpu" and ("," in args.devices or args.devices == "-1"):
        parser.error(
            f"--devices={args.devices!r} is not valid with --accelerator=cpu; accepted: a number of processes or 'auto'"
        )
    if args.accelerator == "mps" and args.devices not in ("1", "auto", "-1", "0,"):
        parser.error(f"--devices={args.devices!r} is not valid with --accelerator=mps; accepted: 1 (there is one MPS device)")
    return RunConfig(
        script=args.script,
        script_args=rest,
        accelerator=args.accelerator,
        strategy=args.strategy,
        devices=args.devices,
        num_nodes=num_nodes,
        node_rank=args.node_rank,
        main_address=args.main_address.strip(),
        main_port=args.main_port,
        precision=args.precision,
        given=given,
        max_restarts=args.max_restarts,
        rdzv_id=args.rdzv_id,
        shutdown_timeout=args.shutdown_timeout,
        min_nodes=min_nodes,
        rdzv_conf=args.rdzv_conf,
        prog=prog,
        replica_group=args.replica_group,
        num_replica_groups=args.num_replica_groups,
        lighthouse=args.lighthouse,
        taken_after_script=tuple(after),
    )
