"""The GRPO trainer: TRL's GRPOTrainer + PEFT LoRA, generating through the run's server.

Entry point: `grpo train` (cli.py). The run is assembled in runner.py; every place
where TRL itself is overridden lives in trl_overrides.py.
"""
