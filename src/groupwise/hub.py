"""push_to_hub: the model folder (output_dir) to a hub repository, through huggingface_hub (tests mock it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from groupwise.config_base import ConfigError

if TYPE_CHECKING:
    from groupwise.config import GRPOConfig

# what a dumped config holds in place of a token: TRL's to_dict() writes "<HUB_TOKEN>", groupwise's "<hidden>"
PLACEHOLDERS = ("<HUB_TOKEN>", "<hidden>")

# what a push leaves out of output_dir: checkpoints (pushed as the model they hold, not as resume state), logs
IGNORE = ["checkpoint-*", "checkpoint-*/**", ".tmp-*", ".tmp-*/**", ".old-*", ".old-*/**", "runs/**", "*.jsonl", "checksums.json"]


def hub_token(args: GRPOConfig) -> str:
    """hub_token, else HF_TOKEN or the cached `huggingface-cli login`; a ConfigError saying how to log in if none."""
    from huggingface_hub import get_token

    given = args.hub_token if args.hub_token not in PLACEHOLDERS else None
    token = given or os.environ.get("HF_TOKEN") or get_token()
    if not token:
        raise ConfigError("push_to_hub needs a hub token: run `huggingface-cli login`, set HF_TOKEN, or set hub_token")
    return token


def repo_id(args: GRPOConfig) -> str:
    return args.hub_model_id or Path(os.path.abspath(args.output_dir)).name


def push_folder(args: GRPOConfig, folder: str, commit_message: str) -> str:
    """Create the repository if needed and upload `folder` (the model, tokenizer, config); returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=hub_token(args))
    repo = api.create_repo(repo_id(args), private=args.hub_private_repo, exist_ok=True).repo_id
    if args.hub_revision:
        api.create_branch(repo, branch=args.hub_revision, exist_ok=True)
    info = api.upload_folder(repo_id=repo, folder_path=folder, commit_message=commit_message,
                             revision=args.hub_revision, ignore_patterns=IGNORE)
    return str(getattr(info, "commit_url", info))
