"""`grpo prepare`: the run's initializer, once per run before any server or trainer starts.

1. writes `spec.rewardCode.inline` into `sources.inline_rewards_dir` (`grpo run` only);
2. fetches every hf:// source (`sources.fetches`), and every s3:// and https:// one (`sources.object_fetches`,
   in per-version folders of the same layout: `objects`), onto the volume, resumably: files already complete
   (per huggingface_hub's local-dir metadata) are not downloaded again, a failed run keeps the files
   it finished; each source has a folder of its own (SOURCE_RECORD names the source) and in it one
   folder per commit (FETCH_RECORD names the commit), as huggingface_hub's cache: a moved branch is
   fetched into a new folder and a complete commit's folder is never written again, so no fetch
   changes files another run reads; a folder recorded for another source or commit is refused, never
   fetched over, and a folder of the layout before the escaped names (hub/<type>s/ORG/NAME/REVISION)
   is never read; the commit fetched is recorded for the run (`RunConfig.record_fetched_commits`),
   whose server and trainer read that commit's folder; one file failing stops the others at their
   next chunk; the endpoint is not trusted: a file list no repository has, a file going past the size
   the list announces, or a file not at the resolved commit fails the fetch, and the token is never
   sent to another host than the endpoint;
3. checks what the server and trainer will read, in their order: the model directory and its
   tokenizer, the dataset (as the trainer loads it), the reward functions (imported as the trainer
   imports them);
4. fingerprints the model (`grpo_api.fingerprint`: every weight byte hashed once) when its directory
   is writable, so the digests are cached beside the weights before the server and trainer need them;

and says so on stdout in the protocol of `grpo_api.prepare_protocol`. A failure is permanent (exit 2:
a configuration problem, the message names the field) or transient (exit 1: the network or the hub;
the Job retries and the download resumes).

The package, by job: `main` (the entry, `run_prepare`), `inline_rewards` (1), `hub` and `objects` (2: the hf://,
s3:// and https:// fetches), `folders` (2: what every fetch keeps on the volume), `checks` (3 and 4),
`reporting` (the protocol lines, a fetch's progress, the termination message) and `errors` (the failures and
the table that tells a hub error permanent from transient).
"""

from grpo_trainer.prepare.errors import PrepareFailed
from grpo_trainer.prepare.main import run_prepare

__all__ = ["PrepareFailed", "run_prepare"]
