"""The legacy completions API's `logprobs` object, from the entries the engine sends for chat.

`/v1/completions` answers `logprobs` as four parallel lists (`tokens`, `token_logprobs`,
`top_logprobs` as one {token: logprob} map per token, `text_offset`: where each token
starts in the choice's text), where chat answers one entry per token. The engine makes
chat's entries for both routes; this turns a run of them into the legacy object, keeping
the text offset across the chunks of a stream.
"""

from __future__ import annotations

from typing import Any

# A token that ends inside a UTF-8 character is named by its bytes (`bytes:\xNN`); its text comes with a later token.
PARTIAL_TOKEN_PREFIX = "bytes:"


class LegacyLogprobs:
    """Turns the engine's per-token entries into the legacy object; `offset` is where the next token starts."""

    def __init__(self, offset: int = 0):
        self.offset = offset

    def render(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        tokens, logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            token = str(entry.get("token", ""))
            tokens.append(token)
            logprobs.append(entry.get("logprob"))
            alternatives = entry.get("top_logprobs")
            # null for a prompt's first token, as OpenAI answers `echo`: nothing predicts it
            tops.append(None if alternatives is None and entry.get("logprob") is None else
                        {str(top.get("token", "")): top.get("logprob") for top in alternatives or ()})
            offsets.append(self.offset)
            if not token.startswith(PARTIAL_TOKEN_PREFIX):
                self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
