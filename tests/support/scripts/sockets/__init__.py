"""Scripts whose running jobs the socket tests inspect."""
