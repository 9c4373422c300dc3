"""Policy transport: talking to the server and moving the policy into it.

- `server_client`: the HTTP client of one generation server replica;
- `replicas`: the server's replicas used as one server (`ServerPool`), composed of
  - `replica_set`: the replicas found, their health and boots, catch-up and which of them lag,
  - `activation`: a policy version made active on every replica, one round per sync,
  - `dispatch`: a batch's generation spread over the ready replicas,
  - `policy_loaders`: how one replica loads a version (LoRA's `AdapterLoader`, the protocol `WeightLoader` follows);
- `adapter_files`: a LoRA adapter's tensors written in the serving dtype, hashed as written;
- `adapter_store`: adapter versions published on the shared volume;
- `policy_sync`: one sync at a time in the background (`PolicySync`), and LoRA's (`AdapterSync`);
- `weight_sync`: full fine-tuning's sync through vLLM's weight transfer (`WeightSync`, `WeightLoader`);
- `weight_ipc`: the trainer's side of the CUDA IPC weight transfer.

It imports the package's errors, metrics and checkpoints, never the training loop, the launcher or the
initializer (`grpo_trainer.prepare`); pyproject.toml's import contracts hold it to that.
"""
