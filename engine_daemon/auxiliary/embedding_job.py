"""One /v1/embeddings request: inputs tokenized off the mlx thread, vectors gathered from shared batches.

Everything a client controls is bounded before it costs anything: an input of more than
`BYTES_SLACK` times the bytes the model's input-length limit could hold (every token the
vocabulary's longest; the slack covers the whitespace tokenizers drop or merge) is refused by
its size alone, so a 10 MB string never reaches the tokenizer; the others are
tokenized on the admission pool (`prepare`) and refused with a 400 when they are longer than
the model takes. Token-array inputs are used as given (no special tokens added), as OpenAI does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_daemon.auxiliary.jobs import AuxiliaryJob
from engine_daemon.errors import RequestError

if TYPE_CHECKING:
    from engine_daemon.auxiliary.embedding import EmbeddingModel

BYTES_SLACK = 4
# Inputs tokenized together before their lengths are checked (`EmbeddingJob.prepare`).
TOKENIZE_SLICE = 64


@dataclass
class Sequence:
    """One input of one job, waiting in its model's `pending` queue until a slice computes its vector."""

    job: EmbeddingJob
    index: int
    tokens: list[int]


class EmbeddingJob(AuxiliaryJob):
    kind = "embedding"

    def __init__(self, model: EmbeddingModel, inputs: list[Any], dimensions: int | None):
        self.model = model
        self.inputs = inputs
        self.dimensions = dimensions
        self.tokens: list[list[int]] = []
        self.vectors: list[np.ndarray | None] = []
        self.prompt_tokens = 0
        self._left = 0

    # -- admission pool ---------------------------------------------------------------------------
    def prepare(self) -> None:
        """Checks `dimensions`, tokenizes the strings (bounded), checks every input's length and ids."""
        model = self.model
        if self.dimensions is not None and self.dimensions != model.dimensions:
            if not model.supports_dimensions():
                raise RequestError(400, "unsupported_parameter",
                                   f"The model '{model.name}' does not support 'dimensions' (it was not trained for "
                                   f"shorter Matryoshka vectors); omit it to get all {model.dimensions}",
                                   param="dimensions")
            if self.dimensions > model.dimensions:
                raise RequestError(400, "invalid_value", f"'dimensions' must be at most {model.dimensions} for "
                                   f"the model '{model.name}'", param="dimensions")
        if isinstance(self.inputs[0], str):
            limit = BYTES_SLACK * model.max_tokens * model.longest_token_bytes()
            for i, text in enumerate(self.inputs):
                size = len(text.encode("utf-8", "surrogatepass"))
                if size > limit:
                    raise RequestError(400, "context_length_exceeded",
                                       f"input[{i}] is {size} bytes: far more than the model's maximum input length "
                                       f"of {model.max_tokens} tokens could hold; shorten it", param="input")
            # In slices, each checked before the next: a batch whose first input is too long is refused after
            # one slice, not after all of it (2,048 inputs of 4.5 KB took 21-29 s to refuse for input[0]).
            for start in range(0, len(self.inputs), TOKENIZE_SLICE):
                part = model.tokenizer(self.inputs[start:start + TOKENIZE_SLICE], add_special_tokens=True)
                self.tokens += [list(ids) for ids in part["input_ids"]]
                self._check_lengths(start)
        else:
            self.tokens = self.inputs
            for i, ids in enumerate(self.tokens):
                bad = next((t for t in ids if t >= model.vocab_size), None)
                if bad is not None:
                    raise RequestError(400, "invalid_value",
                                       f"input[{i}] holds token id {bad}, outside the model's vocabulary "
                                       f"[0, {model.vocab_size}); token arrays must come from this model's tokenizer "
                                       "(LangChain: check_embedding_ctx_length=False sends text)", param="input")
        self._check_lengths(0)
        self.inputs = []  # the text is no longer needed: free it before the job waits in the queue
        self.vectors = [None] * len(self.tokens)
        self._left = len(self.tokens)

    def _check_lengths(self, start: int) -> None:
        """400 for the first input from `start` on that is longer than the model takes."""
        for i, ids in enumerate(self.tokens[start:], start):
            if len(ids) > self.model.max_tokens:
                raise RequestError(400, "context_length_exceeded",
                                   f"input[{i}] has {len(ids)} tokens; the model's maximum input length is "
                                   f"{self.model.max_tokens} tokens", param="input")

    # -- mlx thread -------------------------------------------------------------------------------
    def queued(self) -> None:
        """Joins its model's shared queue of inputs: any slice may compute them, with other requests' inputs."""
        self.model.pending.extend(Sequence(self, i, ids) for i, ids in enumerate(self.tokens))

    def step(self, budget: int) -> bool:
        if self.model.closed:
            raise RequestError(503, "model_unloaded", "The embedding model was unloaded", error_type="server_error")
        self.last_slice_tokens = 0 if self.finished() else self.model.run(budget)
        return self.finished()

    def deliver(self, index: int, vector: np.ndarray, tokens: int) -> None:
        """A vector of one of this job's inputs, computed by some slice (maybe another job's)."""
        if self.dimensions is not None and self.dimensions < vector.shape[-1]:
            vector = vector[:self.dimensions]
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # Matryoshka: truncate, renormalize
        self.vectors[index] = np.ascontiguousarray(vector, dtype="<f4")
        self.prompt_tokens += tokens
        self._left -= 1

    def finished(self) -> bool:
        return bool(self.vectors) and self._left == 0

    def result(self) -> dict[str, Any]:
        data = [vector.tobytes() for vector in self.vectors]  # raw little-endian float32
        return {"model": self.model.name, "data": data, "dimensions": int(self.vectors[0].shape[-1]),
                "prompt_tokens": self.prompt_tokens}
