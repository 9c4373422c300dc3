"""The export step (`grpo export`): after the trainer's last step, the run's result (the final adapter, or
the base model with it merged in) uploaded to spec.output's destination, and where it went reported."""
