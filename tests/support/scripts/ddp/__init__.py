"""Code that runs inside the ranks of the real 2-process DDP jobs of the tests (popen scripts, spawn functions)."""
