"""The grpo-operator: a kopf operator that reconciles GRPORuns into a health-gated server and trainer.

Layers (outer to inner): `cli` and `handlers` (kopf wiring) -> `reconcile` (observe, decide with
`grpo_api.lifecycle`, act, write status once) -> `builders` (pure manifests) and the clients
`kube` (Kubernetes API) and `health` (the server's health endpoint).
"""
