"""push_to_hub: the model folder (output_dir) to a hub repository, and log_completions_hub_repo: the completions
tables to a dataset repository; through huggingface_hub (tests mock it)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from groupwise.config_base import ConfigError
from groupwise.trackers import Opened

if TYPE_CHECKING:
    from groupwise.config import GRPOConfig

# what a dumped config holds in place of a token: TRL's to_dict() writes "<HUB_TOKEN>", groupwise's "<hidden>"
PLACEHOLDERS = ("<HUB_TOKEN>", "<hidden>")

# what a push leaves out of output_dir: checkpoints (pushed as the model they hold, not as resume state), logs
IGNORE = ["checkpoint-*", "checkpoint-*/**", ".tmp-*", ".tmp-*/**", ".old-*", ".old-*/**", ".setting-aside*", "runs/**", "*.jsonl", "checksums.json"]


def hub_token(args: GRPOConfig, needed_by: str = "push_to_hub") -> str:
    """hub_token, else HF_TOKEN or the cached `hf auth login`; a ConfigError saying how to log in if none."""
    from huggingface_hub import get_token

    given = args.hub_token if args.hub_token not in PLACEHOLDERS else None
    token = given or os.environ.get("HF_TOKEN") or get_token()
    if not token:
        raise ConfigError(f"{needed_by} needs a hub token: run `hf auth login`, set HF_TOKEN, or set "
                          "hub_token")
    return token


def completions_uploader(args: GRPOConfig, folder: str) -> Opened:
    """log_completions_hub_repo (TRL): the dataset repository, created with its card, that huggingface_hub's
    CommitScheduler uploads `folder`'s parquet files to every 2 minutes (what changed since the last upload), as
    TRL's; closing it uploads what is left (a failure there is a warning: the run is over, its tables on disk), then
    stops the schedule (TRL leaves that last upload to the interpreter's exit)."""
    from huggingface_hub import CommitScheduler, HfApi

    api = HfApi(token=hub_token(args, "log_completions_hub_repo"))
    repo = api.create_repo(args.log_completions_hub_repo, private=args.hub_private_repo, repo_type="dataset",
                           exist_ok=True).repo_id
    card = COMPLETIONS_CARD.format(repo=repo, model=f"\nThe model trained: https://huggingface.co/{args.hub_model_id}\n"
                                   if args.hub_model_id else "")
    api.upload_file(path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id=repo, repo_type="dataset",
                    commit_message="groupwise: completions dataset card")
    scheduler = CommitScheduler(repo_id=repo, repo_type="dataset", folder_path=folder, every=2,
                                allow_patterns=["*.parquet"], hf_api=api)

    def close(failed: bool) -> None:
        try:
            scheduler.trigger().result()  # the last steps' files, a failed run's too
        except Exception as e:  # noqa: BLE001 — the run is over and its tables are on disk: say so, do not fail it
            warnings.warn(f"log_completions_hub_repo: the last upload to {repo} failed ({type(e).__name__}: {e}); "
                          f"the tables are in {folder}: upload them with `hf upload {repo} {folder} --repo-type "
                          "dataset`", RuntimeWarning, stacklevel=2)
        finally:
            scheduler.stop()

    return Opened(lambda step, metrics: None, close)


COMPLETIONS_CARD = """---
pretty_name: groupwise completion logs
tags: [groupwise, grpo, completions]
---

# groupwise completion logs

The completions sampled while training with groupwise (GRPO, DeepSeekMath §4.1), written by `log_completions`.
{model}
Each parquet file holds one logged step: `step`, `prompt`, `completion`, one column per reward function, any
`log_extra` columns, and `advantage`. Load them with `datasets.load_dataset("{repo}")`.
"""


def repo_id(args: GRPOConfig) -> str:
    return args.hub_model_id or Path(os.path.abspath(args.output_dir)).name


def push_folder(args: GRPOConfig, folder: str, commit_message: str, *, token: str | None = None,
                revision: str | None = None, private: bool | None = None, **where) -> str:
    """Create the repository if needed and upload `folder` (the model, tokenizer, config, model card; not what IGNORE
    names); returns upload_folder's CommitInfo (a str: the commit URL, with .oid / .commit_url / .pr_url), as
    transformers' Trainer.push_to_hub returns it. token / revision / private: this call's values in place of hub_token,
    hub_revision, hub_private_repo. `where`: upload_folder's path_in_repo / ignore_patterns / delete_patterns."""
    from huggingface_hub import HfApi

    revision = revision or args.hub_revision
    api = HfApi(token=token or hub_token(args))
    repo = api.create_repo(repo_id(args), private=args.hub_private_repo if private is None else private,
                           exist_ok=True).repo_id
    if revision:
        api.create_branch(repo, branch=revision, exist_ok=True)
    where = {"ignore_patterns": list(IGNORE), **where}  # a copy: upload_folder appends to the list it is given
    info = api.upload_folder(repo_id=repo, folder_path=folder, commit_message=commit_message, revision=revision,
                             **where)
    return info if isinstance(info, str) else str(getattr(info, "commit_url", info))


def push_checkpoint(args: GRPOConfig, folder: str, commit_message: str) -> str:
    """hub_strategy 'checkpoint' / 'all_checkpoints' (transformers'): the checkpoint folder, whole (checksums.json
    too: a download resumes), to the repository's last-checkpoint/ folder, whose files from an earlier checkpoint
    are deleted in the same commit (a stale rollout file would be resumed), or to its checkpoint-N/ folder."""
    if args.hub_strategy == "checkpoint":
        return push_folder(args, folder, commit_message, path_in_repo="last-checkpoint", ignore_patterns=None,
                           delete_patterns=["*"])
    return push_folder(args, folder, commit_message, path_in_repo=Path(folder).name, ignore_patterns=None)


# model-card keywords of TRL's push_to_hub (create_model_card) and transformers' (the rest)
CARD_FIELDS = ("model_name", "dataset_name", "tags", "language", "license", "finetuned_from", "tasks", "dataset_tags",
               "dataset", "dataset_args")


def check_card(card: dict) -> None:
    unknown = sorted(set(card) - set(CARD_FIELDS))
    if unknown:
        raise TypeError(f"push_to_hub() got unexpected arguments {unknown} (model-card keywords: {list(CARD_FIELDS)})")


def write_model_card(folder: str, args: GRPOConfig, base_model: str | None, **card) -> None:
    """folder/README.md: a model card (hub metadata and how the model was trained), from push_to_hub's keywords."""
    check_card(card)
    tags = ["groupwise", "grpo", *([card["tags"]] if isinstance(card.get("tags"), str) else card.get("tags") or [])]
    datasets = card.get("dataset_name") or card.get("dataset")
    meta = {"library_name": "transformers", "tags": tags, "base_model": card.get("finetuned_from") or base_model,
            "datasets": [datasets] if isinstance(datasets, str) else datasets, "language": card.get("language"),
            "license": card.get("license")}
    import yaml

    front = yaml.safe_dump({k: v for k, v in meta.items() if v}, sort_keys=False)
    name = card.get("model_name") or repo_id(args)
    body = (f"# {name}\n\nTrained with [groupwise](https://pypi.org/project/groupwise/): GRPO (DeepSeekMath §4.1) "
            f"with {args.supervision} supervision, loss_type {args.loss_type}"
            + (f", from {meta['base_model']}" if meta["base_model"] else "")
            + (f", on {datasets}" if datasets else "") + ".\n")
    Path(folder, "README.md").write_text(f"---\n{front}---\n\n{body}")
