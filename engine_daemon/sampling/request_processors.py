"""A request's own logits processors (thinking budget, grammar constraint, min_tokens) from a small, plain spec.

Why a spec: an engine group's followers must build the very same processors as rank 0 without
the request (they never see it). The processors are deterministic functions of the tokenizer,
the spec and the tokens generated so far, and every rank generates the same tokens (checked by
the group's token checksums), so rank 0 carries the spec in the plan's `add` and each rank
builds its own copy. A single engine builds them from the same spec at admission.
"""

from __future__ import annotations

from typing import Any

from engine_daemon.sampling.min_tokens import MinTokens
from engine_daemon.sampling.structured import constraint_for
from engine_daemon.sampling.thinking import make_thinking_budget

SPEC_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")


def processor_spec(params: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """What the processors depend on besides the tokenizer and the prompt (msgpack-able: it rides in plans)."""
    return {"thinking_budget": params.get("thinking_budget"), "min_tokens": params.get("min_tokens"),
            **{name: body.get(name) for name in SPEC_FIELDS}}


def build_processors(tokenizer: Any, spec: dict[str, Any], in_thinking: bool) -> list[Any]:
    """The thinking budget, the grammar constraint (structured output, forced tool calls), then min_tokens.

    min_tokens goes last: it sees the grammar's mask and holds EOS back only while another token is allowed.
    """
    processors = []
    budget = make_thinking_budget(tokenizer, spec.get("thinking_budget"), in_thinking)
    if budget is not None:
        processors.append(budget)
    constraint = constraint_for(tokenizer, spec.get("response_format"), spec.get("tools"), spec.get("tool_choice"),
                                spec.get("parallel_tool_calls"), starts_in_thinking=in_thinking)
    if constraint is not None:
        processors.append(constraint)
    if spec.get("min_tokens"):
        processors.append(MinTokens(getattr(tokenizer, "eos_token_ids", None) or [], int(spec["min_tokens"])))
    return processors
