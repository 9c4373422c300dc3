"""`grpo stage`: copy local files (model, dataset, reward code) onto a PersistentVolumeClaim, or
small ones into a ConfigMap.

Only the Kubernetes API is used (no hub, no registry: it works on an air-gapped cluster). A short-lived
pod mounts the claim; a tar stream built here goes to a receiver program run in that pod through
`pods/exec`, which checks every member, writes and fsyncs the files into a hidden staging directory,
verifies them against the sender's checksums and only then moves each destination into place. The
receiver prints what it wrote, which is compared again with what was sent.

Modules: `paths` (SRC:DEST arguments, pure), `sources` (the local files to send), `tarstream` (the
tar stream and its checksums), `receiver` (the program the pod runs: stdlib only), `manifests` (pod
and claim manifests, pod states, exec status, manifest comparison: pure), `configmap` (files to a
ConfigMap's data and binaryData, its size limit: pure), `progress`, `kube` (the API calls) and `cli`.
"""
