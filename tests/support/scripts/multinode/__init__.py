"""Scripts that the CLI, multi-node, logger and example tests run as real processes."""
