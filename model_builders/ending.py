"""Random-weight models that end their replies: a fixed short answer, then the end-of-turn token.

Why: random weights never emit an end token, so a client that waits for the end of a turn
(an agent's `stop_reason: end_turn`, `response.completed`) never gets it. A model built with
`ends_after=N` still loads through the real `mlx_lm.load` and runs every layer, but its
weights make greedy *and* sampled decoding walk a fixed chain of N ordinary word tokens and
then `<|im_end|>`, whatever the prompt.

How, in the weights alone: the transformer blocks' outputs are scaled down so the residual
stream stays close to the current token's embedding, and embeddings and an untied output
layer are laid out on orthogonal directions. Every ordinary token embeds near one shared
direction `u`; chain token k embeds on its own direction `f_k`. The output row of the first
chain token points along `u`, the row of chain token k+1 along `f_k`, the end token's along
`f_N`: each step's largest logit (by ~40) is the next link of the chain.
"""

from __future__ import annotations

import json
from typing import Any

# Logit gained by the next link of the chain (the rest stay ~N(0, 1)): near-certain at temperature 1.
LINK_LOGIT = 40.0
# The blocks' residual outputs are scaled by this, so they cannot outvote the embedding.
BLOCK_OUTPUT_SCALE = 0.02
# Spread of ordinary tokens' embeddings around `u` (they still differ from each other).
TOKEN_SPREAD = 0.3


def chain_tokens(tokenizer_json: str, count: int) -> list[int]:
    """`count` ordinary word tokens of the trained vocabulary (a leading space, letters only), in id order."""
    vocab: dict[str, int] = json.loads(tokenizer_json)["model"]["vocab"]
    words = sorted(token_id for token, token_id in vocab.items()
                   if token.startswith("Ġ") and token[1:].isalpha() and token[1:].islower() and len(token) > 3)
    if len(words) < count:
        raise ValueError(f"the vocabulary has only {len(words)} word tokens for a chain of {count}")
    return words[:count]


def make_it_end(weights: dict[str, Any], config: dict, chain: list[int], end_token: int, seed: int) -> None:
    """Rewrites `weights` (an untied-output model's) so decoding walks `chain` then emits `end_token`."""
    import mlx.core as mx

    hidden = config["hidden_size"]
    if len(chain) + 1 >= hidden:
        raise ValueError(f"a chain of {len(chain)} tokens needs more than hidden_size={hidden} directions")
    if "lm_head.weight" not in weights:
        raise ValueError("ends_after needs an untied output layer (tie_word_embeddings: false)")
    # Orthonormal directions: u, then f_1..f_N (QR of a seeded random matrix).
    basis, _ = mx.linalg.qr(mx.random.normal((hidden, len(chain) + 1), key=mx.random.key(seed + 7919)),
                            stream=mx.cpu)
    directions = basis.T  # (N + 1, hidden), unit rows
    u, links = directions[0], directions[1:]
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * BLOCK_OUTPUT_SCALE
    embed_name = next(name for name in weights if name.endswith("embed_tokens.weight"))
    vocab = weights[embed_name].shape[0]
    noise = weights[embed_name] / (mx.linalg.norm(weights[embed_name], axis=-1, keepdims=True, stream=mx.cpu) + 1e-6)
    embed = u[None, :] + TOKEN_SPREAD * noise
    head = weights["lm_head.weight"]
    rows = mx.arange(vocab)
    for k, token in enumerate(chain):
        embed = mx.where((rows == token)[:, None], links[k][None, :], embed)
    targets = [(chain[0], u)] + [(chain[k + 1], links[k]) for k in range(len(chain) - 1)] + [(end_token, links[-1])]
    scale = LINK_LOGIT / hidden ** 0.5  # the final norm makes the hidden state's length sqrt(hidden)
    for token, direction in targets:
        head = mx.where((rows == token)[:, None], (scale * direction)[None, :], head)
    weights[embed_name] = embed.astype(mx.float32)
    weights["lm_head.weight"] = head.astype(mx.float32)
