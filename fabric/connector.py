"""Turns the user's arguments (and the environment) into one configured Strategy.

This is the only place that parses user strings: accelerator, strategy, devices, num_nodes, precision
and plugins are checked here, where they enter, so errors name the argument the user wrote.
"""

from __future__ import annotations

from typing import Any

from fabric._core.env import cli_option
from fabric._core.suggestions import did_you_mean
from fabric.accelerators import ACCELERATOR_REGISTRY, Accelerator, CPUAccelerator, CUDAAccelerator, MPSAccelerator
from fabric.input_types import AcceleratorInput, DevicesInput, PluginInput, PrecisionInput, StrategyInput
from fabric.plugins.io import CheckpointIO
from fabric.plugins.precision import Precision, normalize_precision, precision_for
from fabric.strategies import STRATEGY_REGISTRY, strategy_class
from fabric.strategies.strategy import ConnectorChoices, Strategy

_ENV_ARGUMENTS = ("accelerator", "strategy", "devices", "num_nodes", "precision")
_DEFAULTS: dict[str, Any] = {"accelerator": "auto", "strategy": "auto", "devices": "auto", "num_nodes": 1, "precision": None}


class Connector:
    def __init__(
        self,
        accelerator: AcceleratorInput = "auto",
        strategy: StrategyInput = "auto",
        devices: DevicesInput = "auto",
        num_nodes: int = 1,
        precision: PrecisionInput = None,
        plugins: PluginInput = None,
    ) -> None:
        accelerator = _from_environment("accelerator", accelerator)
        strategy = _from_environment("strategy", strategy)
        devices = _from_environment("devices", devices)
        num_nodes = _from_environment("num_nodes", num_nodes)
        precision = _from_environment("precision", precision)

        precision_plugin, checkpoint_io, environment = _split_plugins(plugins)
        if precision_plugin is not None and precision is not None:
            raise ValueError(
                f"precision={precision!r} and a precision plugin {precision_plugin!r} were both given; pass only one"
            )
        self.precision = normalize_precision(precision) if precision_plugin is None else precision_plugin.precision
        self.num_nodes = _parse_num_nodes(num_nodes)
        if environment is None:
            from fabric.plugins.environments import detect_cluster_environment

            environment = detect_cluster_environment()
        self.cluster_environment = environment
        self.accelerator = _select_accelerator(accelerator, strategy)
        devices, self.num_nodes = _devices_from_cluster(devices, self.num_nodes, environment)
        self.parallel_devices = self.accelerator.get_parallel_devices(self.accelerator.parse_devices(devices))
        environment.validate_settings(num_devices=len(self.parallel_devices), num_nodes=self.num_nodes)
        device_type = self.parallel_devices[0].type
        if precision_plugin is None:
            self.precision = _precision_on_device(self.precision, device_type)
            precision_plugin = precision_for(self.precision, device_type)
        else:
            precision_plugin.validate_device(device_type)
        self.strategy = self._build_strategy(strategy, precision_plugin, checkpoint_io)

    def _build_strategy(self, strategy: Any, precision: Precision, checkpoint_io: CheckpointIO | None) -> Strategy:
        if isinstance(strategy, Strategy):
            instance = strategy
        elif isinstance(strategy, str):
            name = strategy.lower()
            if name == "auto":
                multi = len(self.parallel_devices) > 1 or self.num_nodes > 1
                name = "ddp" if multi else "single_device"
            if name == "dp" and self.parallel_devices[0].type == "cpu":
                from fabric.utilities.rank_zero import rank_zero_warn

                # DataParallel splits a batch over GPUs; on the CPU, processes (DDP) do the same job
                rank_zero_warn("strategy='dp' is not supported on the CPU; using strategy='ddp' instead, as Lightning Fabric does", stacklevel=5)
                name = "ddp"
            if name not in STRATEGY_REGISTRY:
                accepted = ", ".join(repr(n) for n in ("auto", *STRATEGY_REGISTRY))
                raise ValueError(
                    f"strategy={strategy!r} is not a known strategy; accepted: {accepted}, or a Strategy instance"
                    + did_you_mean(strategy, ("auto", *STRATEGY_REGISTRY))
                )
            if name == "single_device" and (len(self.parallel_devices) > 1 or self.num_nodes > 1):
                raise ValueError(
                    f"strategy='single_device' runs one process on one device, but devices={len(self.parallel_devices)}"
                    f" and num_nodes={self.num_nodes} were asked for; use strategy='ddp'"
                )
            cls, fixed = strategy_class(name)
            instance = cls(device=self.parallel_devices[0]) if name == "single_device" else cls(**fixed)
        else:
            from fabric.utilities.exceptions import InvalidArgumentError

            # Lightning Fabric raises ValueError here, this package raised TypeError: the error is both
            raise InvalidArgumentError(f"strategy={strategy!r} must be a name or a Strategy instance, not {type(strategy).__name__}")
        self._complete(instance, precision, checkpoint_io)
        return instance

    def _complete(self, strategy: Strategy, precision: Precision, checkpoint_io: CheckpointIO | None) -> None:
        """Hand the strategy what was decided here (it keeps the parts it was given), then its launcher."""
        strategy.accept_choices(
            ConnectorChoices(
                accelerator=self.accelerator,
                precision=precision,
                checkpoint_io=checkpoint_io,
                cluster_environment=self.cluster_environment,
                parallel_devices=self.parallel_devices,
                num_nodes=self.num_nodes,
            )
        )
        strategy.configure_launcher()


def _from_environment(name: str, value: Any) -> Any:
    """The value a run command handed over where the code left the argument at its default.

    ``fabric-torch run`` hands ``FABRIC_<NAME>``; Lightning's ``fabric run`` hands ``LT_<NAME>`` (read only in the
    processes it started, ``LT_CLI_USED=1``).
    """
    found = cli_option(name)
    if found is None:
        return value
    variable, env_value, command = found
    default = _DEFAULTS[name]
    if value != default and str(value) != env_value:
        raise ValueError(
            f"Fabric({name}={value!r}) in the code conflicts with --{name.replace('_', '-')}={env_value} given to"
            f" `{command}` ({variable}={env_value}); remove one of them"
        )
    if name == "num_nodes":
        if not env_value.isdigit():
            raise ValueError(f"{variable}={env_value!r} is not a positive integer")
        return int(env_value)
    if name == "devices" and env_value.lstrip("-").isdigit():
        return int(env_value)
    return env_value


def _split_plugins(plugins: Any) -> tuple[Precision | None, CheckpointIO | None, Any]:
    from fabric.plugins.environments import ClusterEnvironment

    if plugins is None:
        return None, None, None
    if not isinstance(plugins, (list, tuple)):
        plugins = [plugins]
    found: dict[type, Any] = {}
    for plugin in plugins:
        for kind in (Precision, CheckpointIO, ClusterEnvironment):
            if isinstance(plugin, kind):
                if kind in found:
                    raise ValueError(f"plugins has more than one {kind.__name__}: {found[kind]!r} and {plugin!r}")
                found[kind] = plugin
                break
        else:
            raise TypeError(
                f"plugins got {plugin!r}; accepted: a Precision, a CheckpointIO or a ClusterEnvironment instance"
            )
    return found.get(Precision), found.get(CheckpointIO), found.get(ClusterEnvironment)


def _parse_num_nodes(num_nodes: Any) -> int:
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r} is not valid; accepted: an int >= 1")
    return num_nodes


def _select_accelerator(accelerator: Any, strategy: Any) -> Accelerator:
    if isinstance(accelerator, Accelerator):
        return accelerator
    if isinstance(strategy, Strategy) and strategy.accelerator is not None and accelerator == "auto":
        return strategy.accelerator
    if not isinstance(accelerator, str):
        raise TypeError(f"accelerator={accelerator!r} must be a name or an Accelerator instance")
    name = accelerator.lower()
    if name == "auto":
        for candidate in (CUDAAccelerator, MPSAccelerator):
            if candidate.is_available():
                return candidate()
        return CPUAccelerator()
    if name == "gpu":
        for candidate in (CUDAAccelerator, MPSAccelerator):
            if candidate.is_available():
                return candidate()
        raise RuntimeError("accelerator='gpu' was asked for, but neither a CUDA nor an MPS device is available")
    if name not in ACCELERATOR_REGISTRY:
        accepted = ", ".join(repr(n) for n in ("auto", "gpu", *ACCELERATOR_REGISTRY))
        raise ValueError(
            f"accelerator={accelerator!r} is not a known accelerator; accepted: {accepted}"
            + did_you_mean(accelerator, ("auto", "gpu", *ACCELERATOR_REGISTRY))
        )
    cls = ACCELERATOR_REGISTRY[name]
    if not cls.is_available():
        raise RuntimeError(f"accelerator={accelerator!r} was asked for, but it is not available on this machine")
    return cls()


def _devices_from_cluster(devices: Any, num_nodes: int, environment: Any) -> tuple[Any, int]:
    """Under torchrun, ``devices="auto"`` means the processes torchrun started on each node."""
    from fabric.plugins.environments import TorchElasticEnvironment

    if devices != "auto" or not isinstance(environment, TorchElasticEnvironment):
        return devices, num_nodes
    per_node = environment.local_world_size()
    world = environment.world_size()
    if num_nodes == 1 and world > per_node:
        num_nodes = world // per_node
    return per_node, num_nodes


def _precision_on_device(precision: str, device_type: str) -> str:
    """The precision that will run on ``device_type``: "16-mixed" on the CPU becomes "bf16-mixed", with a warning."""
    if precision == "16-mixed" and device_type == "cpu":
        from fabric.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            "precision='16-mixed' is not supported on the CPU (float16 autocast needs a GPU); using"
            " precision='bf16-mixed' instead, as Lightning Fabric does",
            stacklevel=5,
        )
        return "bf16-mixed"
    if precision == "bf16-mixed" and device_type == "cuda":
        import torch

        if not torch.cuda.is_bf16_supported():
            raise RuntimeError("precision='bf16-mixed' needs a GPU with bfloat16 support; use precision='16-mixed'")
    return precision
