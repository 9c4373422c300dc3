"""The generation server: FastAPI + an in-process engine (vLLM on GPU, transformers on CPU).

One server per run attempt serves the base model plus the policy's LoRA adapter
versions. Entry point: `grpo serve` (`grpo_server.cli:serve`); endpoints in `app.py`.

Which policy a generation uses is chosen by the request's `model` field:
- omitted, or the served model name (`spec.model.name`): the adapter active when the
  request is admitted, or the base model when none is active;
- `policy-v<N>`: adapter version N, which must still be loaded (404 otherwise);
- `<served model name>:base`: the base model.
A request keeps the adapter it was admitted with until it finishes; requests admitted
after `POST /set_lora_adapter/` returns use the new version. Every generation response
carries the server's boot id and the adapter version that produced it (headers
`X-GRPO-Boot-Id`, `X-GRPO-Adapter-Version`; body fields `boot_id`, `adapter_version`).
"""
