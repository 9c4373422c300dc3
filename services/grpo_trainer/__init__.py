"""The GRPO trainer: TRL's GRPOTrainer + PEFT LoRA, generating through the run's server.

Entry points: `grpo train` and `grpo prepare` (cli.py). The run is assembled in runner.py; every place
where TRL itself is overridden lives in trl_overrides.py. The initializer is the `prepare` package; talking
to the server and moving the policy into it is the `transport` package.
"""
