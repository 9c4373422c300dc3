"""The `GRPORun` spec and status as pydantic v2 models, one module per concern.

These models are the single source of truth for the custom resource: the CRD schema (`grpo crd`,
grpo_api.crd), the run-config the server and trainer read, and the local runner's validation are all
derived from them. Every field carries a one-line description and a default; each model carries its
cross-field rules twice, as CEL (`x-kubernetes-validations`, see `cel`) for the API server and as the
pydantic validator beside it, so `grpo run` refuses the same specs before anything starts.

- `cel`: how a model or field carries its CEL rules.
- `api`: the API's identity and `ApiModel`, the base of every model.
- Kubernetes value types, each naming the upstream validation it mirrors: `names` (object names, keys,
  labels, images), `resources` (quantities, container resources), `env` (environment variables),
  `pods` (extra labels, annotations, volumes and mounts), `scheduling` (tolerations, affinity).
- The spec's sections: `sources` (model, dataset, rewards), `server`, `trainer`, `storage`, `policy`
  (initializer, retries, deadlines, cleanup), and `run` (the spec as a whole, metadata, GRPORun).
- `status`: the observed state.

`grpo_api.models` re-exports the public names of all of them.
"""
