"""Developer tools that work on the source tree itself (not used by the engine at run time)."""
