"""The torch-free core: facts and plumbing that ``fabric run``, the connector and the launchers share.

Every module here imports only the standard library, so the CLI can use them before any rank starts
(``fabric run`` never imports torch), and each rule is written once:

* :mod:`fabric._core.env`: the names of the environment variables (the ``FABRIC_`` prefix, the rank
  variables), the global-rank formula, the rank-environment builder, the one place that exports
  ``MASTER_ADDR``/``MASTER_PORT``, and the free-port finder;
* :mod:`fabric._core.devices`: the syntax of ``devices=`` ("2", "0,1", "[0,1]", -1, "auto");
* :mod:`fabric._core.names`: accelerator and precision names, and the strategy registry's launch facts;
* :mod:`fabric._core.processes`: "is this pid alive", process trees, and stopping process groups.
* :mod:`fabric._core.process_end`: what must run before the process ends, also through ``os._exit``
  (the loggers' last rows and events).
"""
