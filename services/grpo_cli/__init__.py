"""The `grpo` command line: one entry point for every image and the local runner."""
