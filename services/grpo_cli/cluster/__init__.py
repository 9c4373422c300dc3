"""The cluster CLI: `grpo get`, `status`, `logs`, `wait`, `pull`, `cancel`, `suspend` and `resume`.

They talk to the API server with the user's kubeconfig and context, as kubectl does, and import no
torch, transformers or vLLM (an import-linter contract; `pip install 'grpo-operator[cli]'`).

Modules: `client` (credentials, the API calls, errors that name the run and namespace), `render`
(a GRPORun and its events to a table or text: pure), `outcome` (what `wait` decides from a run
object: pure), `logs` (which pod's log to show: pure), `pull` (the final adapter through a pod's
exec, verified against its manifest), `sender` (the program that pod runs: stdlib only) and
`commands` (the click commands, thin).
"""
