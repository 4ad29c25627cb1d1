"""Shared bits of the benchmark scripts: machine description, medians, markdown tables."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def machine() -> str:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} cores{gpu}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}; `{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}`")


def median_time(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def write_table(name: str, title: str, header: list[str], rows: list[list[str]], notes: list[str]) -> str:
    md = [f"# {title}", "", machine(), "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += [""] + notes
    text = "\n".join(md) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
    return text
