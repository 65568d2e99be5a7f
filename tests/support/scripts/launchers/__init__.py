"""Scripts the launcher tests run as real processes."""
