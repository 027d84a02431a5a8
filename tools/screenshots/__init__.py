"""Developer tools (not part of the installed product)."""
