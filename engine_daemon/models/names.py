"""Model names and per-model settings: `--models-config`, `--served-model-name`, `--chat-template-file`.

A request's `model` may be a catalogue id (a directory under a `--model-dir` root,
an HF repo id), a path inside the roots, or a name the operator gave: an alias from
the models-config file, or the `--served-model-name` of the `--model` loaded at start.
Each name carries a `ModelProfile` (sampling defaults, max_tokens, context length,
chat template, tool/reasoning parser, context-overflow mode) that is applied to the
model when it loads, so one set of weights can be served under names with different
settings. Why here and not in `engine_daemon.models.store`: the store finds directories; this module
decides what the operator's names mean. Nothing here imports mlx (the io thread lists
the catalogue while the mlx thread is busy); `apply_profile` runs on the mlx thread.

models.yaml:

    models:
      - alias: fast                      # the name requests use
        repo: mlx-community/Qwen2.5-0.5B-Instruct-4bit   # or  path: /models/qwen  (relative: to this file)
        temperature: 0.2                 # sampling defaults: temperature, top_p, top_k, min_p,
        top_p: 0.9                       #   repetition_penalty, presence_penalty, frequency_penalty, seed
        max_tokens: 512                  # default max_tokens of requests that give none
        context_length: 4096             # overrides the model's max_position_embeddings
        chat_template: qwen.jinja        # a file (relative: to this file), or `model` for the model's own
        tool_parser: json_tools          # an mlx_lm.tool_parsers module, or `none`
        reasoning_parser: qwen3          # think markers: qwen3 / deepseek_r1 / think / longcat / none
        context_overflow: truncate       # error / truncate / summarize
      - alias: "claude-*"                # a glob (fnmatch: * ? [...]): every name it matches reaches this model
        path: /models/qwen               #   (agents hard-code their vendor's model names)
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine_daemon.models.store import ModelNotFound, ModelRef, context_window_of, model_kind, resolve

log = logging.getLogger(__name__)

SAMPLING_KEYS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float), "top_p": (int, float), "top_k": (int,), "min_p": (int, float),
    "repetition_penalty": (int, float), "presence_penalty": (int, float), "frequency_penalty": (int, float),
    "seed": (int,),
}
OVERFLOW_MODES = ("error", "truncate", "summarize")
# reasoning_parser names -> (think start, think end); None turns reasoning parsing off.
REASONING_MARKERS: dict[str, tuple[str, str] | None] = {
    "think": ("<think>", "</think>"), "qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>"),
    "longcat": ("<longcat_think>", "</longcat_think>"), "none": None,
}
GLOB_CHARACTERS = frozenset("*?[")  # an alias with one of these is an fnmatch pattern (`ModelNames.resolve`)
MODEL_OWN_TEMPLATE = "model"  # `chat_template: model` in an entry: the model's own, not --chat-template-file
_ENTRY_KEYS = {"alias", "name", "path", "repo", "max_tokens", "context_length", "chat_template", "tool_parser",
               "reasoning_parser", "context_overflow", "defaults", "embedding_dimensions", *SAMPLING_KEYS}


class ModelsConfigError(ValueError):
    """The models-config file (or a flag feeding it) is invalid: the engine refuses to start."""


@dataclass(frozen=True)
class ModelProfile:
    """What a name says about serving its model, beyond the model's own files."""

    sampling: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    context_length: int | None = None
    chat_template: str | None = None  # template text; None: the model's own
    chat_template_file: str | None = None  # where it came from (logs)
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    context_overflow: str = "error"
    # An embedding model's `dimensions` (Matryoshka truncation): True/False overrides what its files say.
    embedding_dimensions: bool | None = None


@dataclass(frozen=True)
class ModelEntry:
    """A name the operator gave: where its model lives (directory or HF repo id) and how to serve it."""

    name: str
    source: str
    profile: ModelProfile

    @property
    def is_pattern(self) -> bool:
        """`claude-*`: a glob that names every model name it matches, not a name of its own."""
        return not GLOB_CHARACTERS.isdisjoint(self.name)


def read_chat_template(path: str | Path) -> str:
    """A template file: plain Jinja, or JSON holding `chat_template` (as chat_template.json does)."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ModelsConfigError(f"cannot read chat template {path}: {exc}") from None
    if Path(path).suffix == ".json":
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise ModelsConfigError(f"{path}: a .json chat template needs a 'chat_template' string") from None
    if not isinstance(text, str) or not text.strip():
        raise ModelsConfigError(f"chat template {path} is empty")
    return text


def _tool_parser_exists(name: str) -> bool:
    """mlx-lm ships `mlx_lm.tool_parsers.<name>` (looked up on disk: importing mlx_lm loads mlx)."""
    spec = importlib.util.find_spec("mlx_lm")
    locations = spec.submodule_search_locations if spec else None
    return bool(locations) and any((Path(p) / "tool_parsers" / f"{name}.py").is_file() for p in locations)


def check_overflow_mode(mode: str, where: str) -> str:
    if mode not in OVERFLOW_MODES:
        raise ModelsConfigError(f"{where}: context_overflow must be one of {', '.join(OVERFLOW_MODES)}, not {mode!r}")
    return mode


def _positive_int(entry: Mapping[str, Any], key: str, where: str) -> int | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelsConfigError(f"{where}: '{key}' must be a positive integer, not {value!r}")
    return value


def _optional_bool(entry: Mapping[str, Any], key: str, where: str) -> bool | None:
    value = entry.get(key)
    if value is not None and not isinstance(value, bool):
        raise ModelsConfigError(f"{where}: {key} must be true or false")
    return value


def _sampling(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    nested = entry.get("defaults") or {}
    if not isinstance(nested, Mapping):
        raise ModelsConfigError(f"{where}: 'defaults' must be a mapping of sampling settings")
    unknown = set(nested) - set(SAMPLING_KEYS)
    if unknown:
        raise ModelsConfigError(f"{where}: unknown sampling settings {sorted(unknown)}; known: {sorted(SAMPLING_KEYS)}")
    merged = {**nested, **{k: entry[k] for k in SAMPLING_KEYS if k in entry}}
    for key, value in merged.items():
        if isinstance(value, bool) or not isinstance(value, SAMPLING_KEYS[key]):
            raise ModelsConfigError(f"{where}: '{key}' must be a number, not {value!r}")
    return merged


def _entry(raw: Any, base: Path, defaults: ModelProfile, index: int) -> ModelEntry:
    where = f"models-config entry {index + 1}"
    if not isinstance(raw, Mapping):
        raise ModelsConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    unknown = set(raw) - _ENTRY_KEYS
    if unknown:
        raise ModelsConfigError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(_ENTRY_KEYS)}")
    name = raw.get("alias", raw.get("name"))
    if not isinstance(name, str) or not name.strip():
        raise ModelsConfigError(f"{where}: needs an 'alias' (the name requests use)")
    where = f"models-config entry '{name}'"
    if not GLOB_CHARACTERS.isdisjoint(name) and set(raw) - {"alias", "name", "path", "repo"}:
        raise ModelsConfigError(f"{where}: a pattern only says where its names go ('path' or 'repo'); settings "
                                "belong to the model's own name")
    if ("path" in raw) == ("repo" in raw):
        raise ModelsConfigError(f"{where}: give exactly one of 'path' (a model directory) or 'repo' (an HF repo id)")
    if "path" in raw:
        source = str(base / Path(str(raw["path"])).expanduser())
    else:
        source = str(raw["repo"])
    template, template_file = defaults.chat_template, defaults.chat_template_file
    if raw.get("chat_template") is not None:
        if raw["chat_template"] == MODEL_OWN_TEMPLATE:
            template, template_file = None, None
        else:
            template_file = str(base / Path(str(raw["chat_template"])).expanduser())
            template = read_chat_template(template_file)
    tool_parser = raw.get("tool_parser")
    if tool_parser is not None and tool_parser != "none" and not _tool_parser_exists(str(tool_parser)):
        raise ModelsConfigError(f"{where}: no tool parser '{tool_parser}' in mlx_lm.tool_parsers")
    reasoning = raw.get("reasoning_parser")
    if reasoning is not None and reasoning not in REASONING_MARKERS:
        raise ModelsConfigError(f"{where}: reasoning_parser must be one of {sorted(REASONING_MARKERS)}")
    overflow = raw.get("context_overflow")
    profile = ModelProfile(
        sampling=_sampling(raw, where),
        max_tokens=_positive_int(raw, "max_tokens", where),
        context_length=_positive_int(raw, "context_length", where),
        chat_template=template, chat_template_file=template_file,
        tool_parser=tool_parser, reasoning_parser=reasoning,
        context_overflow=check_overflow_mode(overflow, where) if overflow is not None else defaults.context_overflow,
        embedding_dimensions=_optional_bool(raw, "embedding_dimensions", where),
    )
    return ModelEntry(name.strip(), source, profile)


def load_models_config(path: str | Path, defaults: ModelProfile = ModelProfile()) -> list[ModelEntry]:
    """Entries of a models-config YAML file: a `models:` list (or mapping alias -> settings)."""
    import yaml

    path = Path(path).expanduser()
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ModelsConfigError(f"cannot read --models-config {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ModelsConfigError(f"--models-config {path} is not valid YAML: {exc}") from None
    models = document.get("models") if isinstance(document, Mapping) else document
    if isinstance(models, Mapping):  # alias: {settings}
        models = [{"alias": alias, **(settings or {})} for alias, settings in models.items()]
    if not isinstance(models, list):
        raise ModelsConfigError(f"--models-config {path}: expected a 'models:' list of entries")
    entries = [_entry(raw, path.parent.resolve(), defaults, i) for i, raw in enumerate(models)]
    names = [e.name for e in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ModelsConfigError(f"--models-config {path}: aliases given twice: {', '.join(duplicates)}")
    return entries


class ModelNames:
    """The operator's names (aliases, served name) and the profile each model loads with."""

    def __init__(self, entries: Iterable[ModelEntry] = (), defaults: ModelProfile = ModelProfile()):
        self.defaults = defaults
        self.entries: dict[str, ModelEntry] = {}
        for entry in entries:
            if entry.name in self.entries:
                raise ModelsConfigError(f"the model name '{entry.name}' is given twice")
            self.entries[entry.name] = entry
        self._paths: dict[str, Path] = {}  # entry name -> resolved directory (found once, then remembered)

    @classmethod
    def from_options(cls, *, models_config: str | Path | None = None, model: str | None = None,
                     served_model_name: str | None = None, chat_template_file: str | Path | None = None,
                     context_overflow: str = "error") -> ModelNames:
        """Names from the engine's flags; raises ModelsConfigError on anything invalid."""
        template = read_chat_template(chat_template_file) if chat_template_file else None
        defaults = ModelProfile(chat_template=template,
                                chat_template_file=str(chat_template_file) if chat_template_file else None,
                                context_overflow=check_overflow_mode(context_overflow, "--context-overflow"))
        entries = load_models_config(models_config, defaults) if models_config else []
        if served_model_name:
            if not model:
                raise ModelsConfigError("--served-model-name needs --model (the model it names)")
            aliased = next((e for e in entries if e.name == model), None)
            served = (replace(aliased, name=served_model_name) if aliased
                      else ModelEntry(served_model_name, model, defaults))
            if any(e.name == served_model_name for e in entries):
                raise ModelsConfigError(f"--served-model-name '{served_model_name}' is also a models-config alias")
            entries.insert(0, served)  # first: the loaded model's directory is known by this name first
        return cls(entries, defaults)

    def names(self) -> list[str]:
        return [name for name, entry in self.entries.items() if not entry.is_pattern]

    def _pattern_for(self, name: str) -> ModelEntry | None:
        """The first glob alias (in file order) that matches `name` case-sensitively, if any."""
        return next((e for e in self.entries.values() if e.is_pattern and fnmatch.fnmatchcase(name, e.name)), None)

    def source_of(self, name: str) -> str:
        """What to fetch at start for `--model NAME`: an alias's directory or repo, else the name itself."""
        entry = self.entries.get(name)
        return entry.source if entry else name

    def profile_for(self, ref: ModelRef) -> ModelProfile:
        entry = self.entries.get(ref.id)
        return entry.profile if entry else self.defaults

    # -- resolution --------------------------------------------------------------------------
    def _path_of(self, entry: ModelEntry, allow_download: bool) -> Path:
        path = self._paths.get(entry.name)
        if path is None:
            try:
                path = resolve(entry.source, allow_download=allow_download).path  # the operator's own name
            except ModelNotFound as exc:
                raise ModelNotFound(f"The model '{entry.name}' ({entry.source}) cannot be loaded: {exc}") from None
            self._paths[entry.name] = path
        return path

    def _owner_of(self, path: Path) -> ModelEntry | None:
        """The first name whose model is the directory `path`: it is served under that name, with its settings."""
        for entry in self.entries.values():
            if entry.is_pattern:
                continue
            try:
                if self._path_of(entry, allow_download=False) == path:
                    return entry
            except ModelNotFound:
                continue
        return None

    def resolve(self, name: str, *, default_model: str | None, roots: Sequence[Path],
                allow_download: bool) -> ModelRef:
        """A request's (or the start's) model name as a ModelRef; raises ModelNotFound / InvalidModelName.

        An operator's name maps to its source. Any other name is confined to the roots and
        the HF cache (the `--model` typed at start excepted); when it lands on the directory
        of a named model, it is that model, so asking for the repo of the served model does
        not load the same weights a second time.
        """
        entry = self.entries.get(name)
        if entry is not None:
            return ModelRef(entry.name, self._path_of(entry, allow_download))
        pattern = self._pattern_for(name)
        if pattern is not None:
            # Served under the first name of its directory (the served name when it is the loaded model), so
            # `claude-opus-…` and `claude-haiku-…` share one load and the answer names the model that ran.
            path = self._path_of(pattern, allow_download)
            owner = self._owner_of(path)
            return ModelRef(owner.name, path) if owner else ModelRef(pattern.source, path)
        ref = resolve(name, allow_download=allow_download, roots=None if name == default_model else roots)
        owner = self._owner_of(ref.path)
        return ModelRef(owner.name, ref.path) if owner else ref

    # -- catalogue -----------------------------------------------------------------------------
    def catalogue(self) -> list[dict[str, Any]]:
        """The named models that are on disk, as /v1/models entries (the profile's context length wins)."""
        listed = []
        for entry in self.entries.values():
            if entry.is_pattern:
                continue  # a pattern is not a name: the names it matches reach a listed model
            try:
                path = self._path_of(entry, allow_download=False)
            except ModelNotFound:
                continue
            try:
                created = int(os.stat(path).st_mtime)
            except OSError:
                created = 0
            listed.append({"id": entry.name, "created": created, "path": str(path), "kind": model_kind(path),
                           "context_window": entry.profile.context_length or context_window_of(path)})
        return listed

    def name_of_path(self, path: str | Path | None) -> str | None:
        """The operator's name for a directory, if it has one (for the catalogue's `loaded` flags)."""
        if not path:
            return None
        owner = self._owner_of(Path(path))
        return owner.name if owner else None


# -- applying a profile to a loaded model (mlx thread) ---------------------------------------------
def apply_profile(loaded: Any, profile: ModelProfile) -> None:
    """Makes a freshly loaded model follow its name's settings (`ModelManager` calls it).

    The tokenizer changes go through mlx-lm TokenizerWrapper's own fields (the chat
    template of the wrapped HF tokenizer, the tool-call and think markers it inferred
    at load), so everything reading them (build_prompt, OutputParser, the thinking
    budget) follows without knowing about profiles.
    """
    loaded.profile = profile
    if profile.context_length:
        loaded.context_window = profile.context_length
    if profile.sampling:
        loaded.generation_defaults = {**loaded.generation_defaults, **profile.sampling}
    tokenizer = loaded.tokenizer
    if getattr(loaded, "kind", "text") != "text" or not hasattr(tokenizer, "_tokenizer"):
        if profile.chat_template or profile.tool_parser or profile.reasoning_parser:
            log.warning("model %s: chat template and parser settings apply to text models only; ignored",
                        loaded.ref.id)
        return
    if profile.chat_template is not None:
        set_chat_template(tokenizer, profile.chat_template)
        log.info("model %s: chat template from %s", loaded.ref.id, profile.chat_template_file)
        if profile.tool_parser is None:
            set_tool_parser(tokenizer, _inferred_tool_parser(tokenizer))
    if profile.tool_parser is not None:
        set_tool_parser(tokenizer, None if profile.tool_parser == "none" else profile.tool_parser)
    if profile.reasoning_parser is not None:
        set_reasoning_markers(tokenizer, REASONING_MARKERS[profile.reasoning_parser])


def set_chat_template(tokenizer: Any, template: str) -> None:
    """Replaces the template apply_chat_template renders (a Python renderer of the checkpoint included)."""
    tokenizer._tokenizer.chat_template = template
    tokenizer._chat_template = None
    tokenizer.has_chat_template = True


def _inferred_tool_parser(tokenizer: Any) -> str | None:
    """The tool parser mlx-lm would infer from the (new) template; None when it has no inference."""
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser
    except ImportError:
        return None
    return _infer_tool_parser(tokenizer._tokenizer)


def set_tool_parser(tokenizer: Any, name: str | None) -> None:
    """Tool-call markers and parser of `mlx_lm.tool_parsers.<name>`; None: no tool-call parsing."""
    if name is None:
        tokenizer._tool_parser = tokenizer._tool_call_start = tokenizer._tool_call_end = None
        tokenizer._tool_call_start_tokens = tokenizer._tool_call_end_tokens = None
        return
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    tokenizer._tool_parser = module.parse_tool_call
    tokenizer._tool_call_start, tokenizer._tool_call_end = module.tool_call_start, module.tool_call_end
    encode = tokenizer._tokenizer.encode
    tokenizer._tool_call_start_tokens = tuple(encode(module.tool_call_start, add_special_tokens=False))
    tokenizer._tool_call_end_tokens = tuple(encode(module.tool_call_end, add_special_tokens=False))


def set_reasoning_markers(tokenizer: Any, markers: tuple[str, str] | None) -> None:
    """Think-block markers for the output parser and thinking budget; None: no reasoning split."""
    if markers is None:
        tokenizer._think_start = tokenizer._think_end = None
        tokenizer._think_start_tokens = tokenizer._think_end_tokens = None
        return
    start, end = markers
    encode = tokenizer._tokenizer.encode
    tokenizer._think_start, tokenizer._think_end = start, end
    tokenizer._think_start_tokens = tuple(encode(start, add_special_tokens=False))
    tokenizer._think_end_tokens = tuple(encode(end, add_special_tokens=False))
