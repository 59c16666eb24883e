"""Tokenizer stand-ins carrying what `OutputParser` reads from mlx-lm's TokenizerWrapper: the thinking and
tool-call markers and a real mlx-lm tool parser per family (Hermes/Qwen JSON, Qwen3-Coder, GLM-4.7, Mistral,
MiniMax-M2, Kimi K2, and Gemma 4, FunctionGemma, pythonic, Kimi K3, MiniCPM5, Muse Spark, LongCat, Laguna),
and one with no family parser (the JSON fallback). The markers are each parser module's own."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

from mlx_lm.tool_parsers import (
    function_gemma,
    gemma4,
    glm47,
    json_tools,
    kimi_k2,
    kimi_k3,
    laguna,
    longcat,
    minicpm5,
    minimax_m2,
    mistral,
    muse_spark,
    pythonic,
    qwen3_coder,
)

QWEN = SimpleNamespace(think_start="<think>", think_end="</think>", tool_call_start="<tool_call>",
                       tool_call_end="</tool_call>", tool_parser=json_tools.parse_tool_call)
CODER = SimpleNamespace(think_start=None, think_end=None, tool_call_start="<tool_call>",
                        tool_call_end="</tool_call>", tool_parser=qwen3_coder.parse_tool_call)
GLM = SimpleNamespace(think_start="<think>", think_end="</think>", tool_call_start="<tool_call>",
                      tool_call_end="</tool_call>", tool_parser=glm47.parse_tool_call)
MISTRAL = SimpleNamespace(think_start=None, think_end=None, tool_call_start="[TOOL_CALLS]", tool_call_end="",
                          tool_parser=mistral.parse_tool_call)
MINIMAX = SimpleNamespace(think_start="<think>", think_end="</think>", tool_call_start="<minimax:tool_call>",
                          tool_call_end="</minimax:tool_call>", tool_parser=minimax_m2.parse_tool_call)
KIMI = SimpleNamespace(think_start="<think>", think_end="</think>", tool_call_start="<|tool_calls_section_begin|>",
                       tool_call_end="<|tool_calls_section_end|>", tool_parser=kimi_k2.parse_tool_call)
NO_PARSER = SimpleNamespace(think_start=None, think_end=None, tool_call_start=None, tool_call_end=None,
                            tool_parser=None)


def family(module: ModuleType) -> SimpleNamespace:
    """A tokenizer of a family whose markers are its parser module's (mlx-lm's TokenizerWrapper takes them so)."""
    return SimpleNamespace(think_start=None, think_end=None, tool_call_start=module.tool_call_start,
                           tool_call_end=module.tool_call_end, tool_parser=module.parse_tool_call)


GEMMA4, FUNCTION_GEMMA, PYTHONIC = family(gemma4), family(function_gemma), family(pythonic)
KIMI3, MINICPM5, MUSE, LONGCAT, LAGUNA = family(kimi_k3), family(minicpm5), family(muse_spark), family(longcat), \
    family(laguna)
