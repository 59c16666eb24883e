"""A draft model for speculative decoding, cut from a model: its first N transformer blocks.

Why: speculative decoding needs a small model with the same tokenizer. Keeping the
embedding, the first blocks, the final norm and the output head of the main model
gives one that shares the tokenizer by construction and agrees with the main model
more often than an unrelated random model would (a layer-skipping "self-draft"),
so benchmarks on random-weight models see acceptance rates between the extremes
(an unrelated draft: ~0; the model itself: 100%). Tokenizer and chat-template files
are hard-linked (copied where links are not possible).

    python -m model_builders.draft MODEL_DIR OUT_DIR --layers 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["build_truncated_draft", "main"]

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def build_truncated_draft(model_dir: str | Path, out_dir: str | Path, layers: int = 1) -> Path:
    """Writes `model_dir` cut to its first `layers` blocks into `out_dir`; returns `out_dir` (idempotent)."""
    import mlx.core as mx

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= layers <= total:
        raise ValueError(f"layers must be in [1, {total}], got {layers}")
    config["num_hidden_layers"] = layers
    config["mlx_engined_draft_of"] = {"model": str(model_dir), "layers": layers}
    config.pop("mlx_engined_build", None)  # not a `write_build` build: its manifest no longer applies
    if (out_dir / "config.json").is_file() and json.loads((out_dir / "config.json").read_text()) == config:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        for name, value in mx.load(str(shard)).items():
            match = _LAYER.search(name)
            if match is None or int(match.group(2)) < layers:
                weights[name] = value
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",
                                                                                  "model.safetensors.index.json"):
            _link_or_copy(path, out_dir / path.name)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # last: marks done
    log.info("wrote a %d-of-%d-layer draft of %s to %s", layers, total, model_dir, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_builders.draft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_truncated_draft(args.model_dir, args.out_dir, args.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
