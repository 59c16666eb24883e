"""Tokenizer stand-ins carrying what `OutputParser` reads from mlx-lm's TokenizerWrapper: the thinking and
tool-call markers and a real mlx-lm tool parser per family (Hermes/Qwen JSON, Qwen3-Coder, GLM-4.7, Mistral,
MiniMax-M2, Kimi K2), and
one with no family parser (the JSON fallback)."""

from __future__ import annotations

from types import SimpleNamespace

from mlx_lm.tool_parsers import glm47, json_tools, kimi_k2, minimax_m2, mistral, qwen3_coder

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
