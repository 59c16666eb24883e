"""Build a random LoRA adapter for a model directory, in mlx-lm's on-disk format.

Why: the adapter tests and smoke tests need an adapter that goes through exactly the
loading path of a trained one (`adapter_config.json` + `adapters.safetensors`, as
`mlx_lm.lora` writes them), without training. The LoRA layers are made by mlx-lm's own
`linear_to_lora_layers`, so the tensor names are the ones `mlx_lm.load(..., adapter_path=)`
expects. Unlike a fresh training run, `lora_b` is random and non-zero (seeded), so the
adapter really changes the model's output.

    python -m model_builders.adapter MODEL_DIR OUT_DIR [--rank 4] [--scale 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["build_adapter", "main"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapters.safetensors"


def build_adapter(model_dir: str | Path, out_dir: str | Path, *, rank: int = 4, scale: float = 10.0,
                  seed: int = 0, num_layers: int = -1, keys: list[str] | None = None,
                  b_std: float = 0.05) -> Path:
    """Writes a seeded random LoRA adapter for `model_dir` into `out_dir` and returns `out_dir`.

    `num_layers`: LoRA on the last N transformer blocks (-1: all, as mlx_lm.lora's `--num-layers -1`).
    `keys`: module names inside a block (e.g. ["self_attn.q_proj"]); None means every linear layer,
    mlx-lm's default. Same arguments give the same bytes.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    model, config = load_model(model_dir, lazy=True)
    layers = len(model.layers)
    num_layers = layers if num_layers < 0 else min(num_layers, layers)
    lora_parameters: dict = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys:
        lora_parameters["keys"] = list(keys)
    linear_to_lora_layers(model, num_layers, lora_parameters)
    names = sorted(name for name, _ in tree_flatten(model.parameters())
                   if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b"))
    if not names:
        raise ValueError(f"no LoRA layers were made for {model_dir} (keys={keys})")
    params = dict(tree_flatten(model.parameters()))
    draws = mx.random.split(mx.random.key(seed), len(names))  # one key per tensor, in name order
    weights = {}
    for name, draw in zip(names, draws):
        shape = params[name].shape
        if name.endswith("lora_a"):
            bound = 1.0 / shape[0] ** 0.5  # mlx-lm's own lora_a init
            weights[name] = mx.random.uniform(-bound, bound, shape, dtype=mx.float32, key=draw)
        else:
            weights[name] = mx.random.normal(shape, dtype=mx.float32, key=draw) * b_std
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / ADAPTER_WEIGHTS), weights, metadata={"format": "mlx"})
    adapter_config = {
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": lora_parameters,
        "model": str(model_dir),
        "note": "RANDOM LoRA ADAPTER, NOT TRAINED. Built by model_builders.adapter.",
        "seed": seed,
    }
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    log.info("wrote a rank-%d LoRA adapter (%d tensors) for %s to %s", rank, len(weights), model_dir, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_builders.adapter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=-1)
    parser.add_argument("--keys", nargs="*", default=None, help="module names inside a block (default: all linear)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_adapter(args.model_dir, args.out_dir, rank=args.rank, scale=args.scale, seed=args.seed,
                  num_layers=args.num_layers, keys=args.keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
