"""Policy transport: talking to the server and moving the policy into it.

- `server_client`: the HTTP client of one generation server replica;
- `replicas`: the server's replicas used as one server (`ServerPool`);
- `adapter_files`: a LoRA adapter's tensors written in the serving dtype, hashed as written;
- `adapter_store`: adapter versions published on the shared volume;
- `policy_sync`: one sync at a time in the background (`PolicySync`), and LoRA's (`AdapterSync`);
- `weight_sync`: full fine-tuning's sync through vLLM's weight transfer (`WeightSync`);
- `weight_ipc`: the trainer's side of the CUDA IPC weight transfer.

It imports the package's errors, metrics and checkpoints, never the loop, the launcher or the initializer.
"""
