"""Stand-in for vllm.utils.network_utils: `get_ip()`, the address TRL's client gives the server as the
weight-transfer group's master (vLLM: VLLM_HOST_IP, else the address of the default route). The stand-in runs
client and server on one machine: VLLM_HOST_IP, else the loopback address."""

from __future__ import annotations

import os


def get_ip() -> str:
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
