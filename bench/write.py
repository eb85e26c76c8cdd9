"""The one way the benchmarks write their results: <out>/<stem>.json and <stem>.md, the markdown also printed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(out: Path, stem: str, results: dict[str, Any], markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
