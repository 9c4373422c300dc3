"""`grpo run`: the embedded default. The operator's lifecycle, executed with local processes."""
