"""Anthropic's schema-less client tools (bash, text editor, memory) as the function tools a local model can call.

Anthropic defines these tools itself: a request names only the versioned `type` and the fixed `name`
(`{"type": "bash_20250124", "name": "bash"}`), the client runs the calls. Claude knows their input
shape from training; a local model must be shown it, so each becomes a function tool with the input
schema Anthropic documents for it (docs.anthropic.com, "Bash tool", "Text editor tool" and "Memory
tool"; the SDK's `BetaMemoryTool20250818*Command` types), and its calls come back as `tool_use` blocks
under that fixed name, which the client's tool runner expects. Other Anthropic tool types (web
search, code execution, computer use, …) stay hosted: left out.
"""

from __future__ import annotations

from typing import Any

from http_frontend.errors import bad_request

_BASH = {
    "description": "Run a command in a persistent bash shell session and see its output.",
    "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The bash command to run (not needed with restart)."},
            "restart": {"type": "boolean", "description": "true restarts the bash session."},
        },
    },
}
_EDITOR_COMMANDS = ["view", "create", "str_replace", "insert", "undo_edit"]


def _editor(commands: list[str]) -> dict[str, Any]:
    """The text editor's input schema with these commands (Claude 4's versions have no `undo_edit`)."""
    return {
        "description": "View, create and edit text files: " + ", ".join(commands) + ".",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "enum": commands, "description": "The command to run."},
                "path": {"type": "string", "description": "The file or directory to act on."},
                "file_text": {"type": "string", "description": "create: the new file's content."},
                "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
                "new_str": {"type": "string",
                            "description": "str_replace: the replacement; insert: the text to insert."},
                "insert_line": {"type": "integer",
                                "description": "insert: the line after which to insert (0: the file's start)."},
                "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2,
                               "description": "view: [first, last] line, 1-based; last -1 reads to the end."},
            },
            "required": ["command", "path"],
        },
    }


# The memory tool's commands and their inputs: view (path, view_range?), create (path, file_text), str_replace
# (path, old_str, new_str), insert (path, insert_line, insert_text), delete (path), rename (old_path, new_path).
# One flat object, as the text editor's: templates that list `properties` show every field.
_MEMORY = {
    "description": "Memories that persist across conversations, kept as files under /memories: view a directory "
                   "or a file, create, str_replace, insert, delete, rename. View /memories before starting a task, "
                   "and record progress and what you learn there as you go.",
    "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "delete", "rename"],
                        "description": "The command to run."},
            "path": {"type": "string", "description": "The file or directory under /memories to act on (every "
                                                      "command but rename)."},
            "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2,
                           "description": "view (optional): [first, last] line of a file to show."},
            "file_text": {"type": "string", "description": "create: the new file's content."},
            "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
            "new_str": {"type": "string", "description": "str_replace: the replacement."},
            "insert_line": {"type": "integer", "description": "insert: the line number where the text goes."},
            "insert_text": {"type": "string", "description": "insert: the text to insert."},
            "old_path": {"type": "string", "description": "rename: the current path of the file or directory."},
            "new_path": {"type": "string", "description": "rename: its new path."},
        },
        "required": ["command"],
        "additionalProperties": False,
    },
}


# type -> (the name Anthropic fixes for it, its function tool)
CLIENT_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {
    "bash_20241022": ("bash", _BASH),
    "bash_20250124": ("bash", _BASH),
    "text_editor_20241022": ("str_replace_editor", _editor(_EDITOR_COMMANDS)),
    "text_editor_20250124": ("str_replace_editor", _editor(_EDITOR_COMMANDS)),
    "text_editor_20250429": ("str_replace_based_edit_tool", _editor(_EDITOR_COMMANDS[:-1])),
    "text_editor_20250728": ("str_replace_based_edit_tool", _editor(_EDITOR_COMMANDS[:-1])),
    "memory_20250818": ("memory", _MEMORY),
}


def client_tool(tool: dict[str, Any], param: str) -> dict[str, Any]:
    """The chat function tool for a bash / text editor / memory tool definition; a name other than the fixed one is a
    400, as Anthropic answers (the client's runner dispatches on that name)."""
    name, function = CLIENT_TOOLS[tool["type"]]
    given = tool.get("name", name)
    if given != name:
        raise bad_request(f"{param}.name: a '{tool['type']}' tool must be named '{name}', got {given!r}",
                          param=f"{param}.name")
    return {"type": "function", "function": {"name": name, **function}}
