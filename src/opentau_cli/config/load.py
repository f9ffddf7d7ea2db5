"""Build a TrainConfig from a JSON file, the environment and dotted command-line overrides."""

from __future__ import annotations

import difflib
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ValidationError
from pydantic_settings import EnvSettingsSource
from pydantic_settings.exceptions import SettingsError

from opentau_cli.errors import UserError
from opentau_cli.config.model import TrainConfig
from opentau_cli.config.paths import REPO_ID_KEYS, is_path_key, paths_base, resolve_paths, resolve_value

# OPENTAU_* variables that are not config keys.
NON_CONFIG_ENV = {"OPENTAU_DEBUG", "OPENTAU_CACHE_DIR", "OPENTAU_LOG_LEVEL", "OPENTAU_SERVE_API_KEY"}
# Where `--config_path=examples/x.json` is also looked up (the contract allows dropping the `configs/` prefix).
CONFIG_SEARCH_DIRS = ("configs",)


def all_keys(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config, nested sections included."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        key = prefix + name
        keys.append(key)
        sub = _section_type(field.annotation)
        if sub is not None:
            keys.extend(all_keys(sub, key + "."))
    return keys


def suggest(key: str) -> str:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    if not close:  # a misspelt leaf under the right section is the common case: match the last part too
        leaves = {k.rsplit(".", 1)[-1]: k for k in all_keys()}
        leaf = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.6)
        close = [leaves[leaf[0]]] if leaf else []
    return f" (did you mean '{close[0]}'?)" if close else ""


def _section_type(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _list_item_section(annotation: Any) -> type[BaseModel] | None:
    """The section type of a `list[Section] | None` field (e.g. dataset.mixture), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is list:
            args = typing.get_args(candidate)
            return _section_type(args[0]) if args else None
    return None


def _field_annotation(key: str) -> Any:
    """The annotation of a dotted key; a number after a list of sections picks an item (`dataset.mixture.0.root`)."""
    model: type[BaseModel] = TrainConfig
    parts = key.split(".")
    i = 0
    while i < len(parts):
        field = model.model_fields.get(parts[i])
        if field is None:
            raise UserError(f"Unknown config key '{key}'{suggest(key)}.")
        if i == len(parts) - 1:
            return field.annotation
        sub = _section_type(field.annotation)
        item = _list_item_section(field.annotation)
        if sub is None and item is not None and parts[i + 1].isdigit() and i + 2 < len(parts):
            sub, i = item, i + 1
        if sub is None:
            raise UserError(f"Unknown config key '{key}': '{'.'.join(parts[: i + 1])}' is not a section{suggest(key)}.")
        model = sub
        i += 1
    raise AssertionError("unreachable")


def _is_text(annotation: Any) -> bool:
    """True when the field holds text, so '123' must stay a string and not become a number."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_is_text(a) for a in args if a is not type(None))
    if origin is Literal:
        return all(isinstance(a, str) for a in args)
    return annotation in (str, Path)


def coerce_value(key: str, raw: str) -> Any:
    annotation = _field_annotation(key)
    optional = type(None) in typing.get_args(annotation)
    if optional and raw.strip().lower() in ("null", "none"):
        return None
    if _is_text(annotation):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # let pydantic judge it ("True", "yes", ...)


def _is_bool(annotation: Any) -> bool:
    """True for a bool field (optional or not): the only kind a bare `--flag` may set."""
    return annotation is bool or (typing.get_origin(annotation) in (typing.Union, types.UnionType)
                                  and {a for a in typing.get_args(annotation) if a is not type(None)} == {bool})


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`--k v` and `--k=v` into {dotted key: raw string}. A bare `--flag` means true for a bool field only (e.g.
    `--resume`); any other key without a value is refused: `--steps` alone must not quietly mean 1, nor
    `--output_dir` alone a folder named `true`."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise UserError(f"Unexpected argument '{arg}': overrides look like --key=value or --key value.")
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value = body, args[i + 1]
            i += 1
        else:
            key, value = body, None
        key = key.replace("-", "_")
        annotation = _field_annotation(key)  # unknown keys fail here, with a suggestion
        if value is None:
            if not _is_bool(annotation):
                raise UserError(f"--{key} needs a value: --{key}=VALUE or --{key} VALUE.")
            value = "true"
        elif not value.strip() and is_path_key(key):  # '' would resolve to the working directory, ' ' to a path in it
            what = "a local path or a Hugging Face repo id (org/name), or null" if key in REPO_ID_KEYS else "a path"
            raise UserError(f"--{key} is empty: give {what}.")
        out[key] = value
        i += 1
    return out


def _set_dotted(data: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node: Any = data
    for i, part in enumerate(parents):
        if isinstance(node, list):  # an item of a list of sections, by its number (checked by _field_annotation)
            index = int(part)
            if index >= len(node):
                raise UserError(f"--{key}: '{'.'.join(parents[:i])}' has {len(node)} item(s), numbered from 0.")
            node = node[index]
            continue
        child = node.get(part)
        if not isinstance(child, (dict, list)):
            if parents[i + 1:i + 2] and parents[i + 1].isdigit():
                raise UserError(f"--{key}: the config has no '{'.'.join(parents[:i + 1])}' list to index.")
            child = {}
            node[part] = child
        node = child
    node[leaf] = value


def deep_merge(base: dict, top: Mapping) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def find_config_file(path: str | Path) -> Path:
    p = Path(path)
    if p.is_file():
        return p
    for base in CONFIG_SEARCH_DIRS:
        if (Path(base) / p).is_file():
            return Path(base) / p
    if p.is_dir():
        raise UserError(f"Config path '{p}' is a directory; pass a JSON file (e.g. {p / 'train_config.json'}).")
    raise UserError(f"Config file '{p}' not found.")


def read_json(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise UserError(f"Config path '{path}' is a directory; pass a JSON file (e.g. {path / 'train_config.json'}).") from None
    except OSError as e:
        raise UserError(f"Cannot read config file '{path}': {e.strerror or e}.") from None
    except UnicodeDecodeError as e:
        raise UserError(f"Config file '{path}' is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                        "save it as UTF-8 JSON.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"Config file '{path}' is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}.") from None
    if not isinstance(data, dict):
        raise UserError(f"Config file '{path}' must hold a JSON object, not {type(data).__name__}.")
    return data


def env_values(environ: Mapping[str, str] | None = None) -> dict:
    """The OPENTAU_* variables as a nested dict (parsed by pydantic-settings); unknown ones are errors."""
    environ = os.environ if environ is None else environ
    valid = set(all_keys())
    for name in environ:
        if name.upper().startswith("OPENTAU_") and name.upper() not in NON_CONFIG_ENV:
            key = name[len("OPENTAU_"):].lower().replace("__", ".")
            if key not in valid:
                raise UserError(f"Environment variable {name} is not a config key{suggest(key)}.")
    try:
        return _read_env(environ)
    except SettingsError:  # a list or a section must be JSON: find the variable that is not, and name it
        for name, value in environ.items():
            if name.upper().startswith("OPENTAU_") and name.upper() not in NON_CONFIG_ENV:
                try:
                    _read_env({name: value})
                except SettingsError:
                    raise UserError(f"Environment variable {name}={value!r} is not valid JSON, which a list or a "
                                    "section takes (e.g. [1, 2] or {\"key\": 1}).") from None
        raise


def _read_env(environ: Mapping[str, str]) -> dict:
    source = EnvSettingsSource(TrainConfig)
    source.env_vars = {k.lower(): v for k, v in environ.items()}
    return source()


def env_origins(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{dotted key: the OPENTAU_* variable that sets it} (what an error about that key names as its origin)."""
    environ = os.environ if environ is None else environ
    return {name[len("OPENTAU_"):].lower().replace("__", "."): name for name in environ
            if name.upper().startswith("OPENTAU_") and name.upper() not in NON_CONFIG_ENV}


def origin_of(key: str, origins: Mapping[str, str], default: str) -> str:
    """Where the value at dotted `key` came from: the longest given key that is `key` or holds it, else `default`."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        found = origins.get(".".join(parts[:n]))
        if found is not None:
            return found
    return default


def format_validation_error(err: ValidationError, origin: str = "", origins: Mapping[str, str] | None = None) -> str:
    """One line per bad value, naming where it came from: `origins` maps dotted keys to their source (`--key`, an
    OPENTAU_* variable); every other key is `origin`'s (" in <file>", or "" for the defaults)."""
    found = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        source = origin_of(key, origins or {}, origin.removeprefix(" in ")) if key else ""
        if e["type"] == "extra_forbidden":
            text = f"unknown config key '{key}'{suggest(key)}"
        else:
            got = e.get("input")
            shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
            text = f"{key}: {e['msg']}{shown}" if key else f"{e['msg']}{shown}"
        found.append((text, source))
    sources = {source for _, source in found}
    if len(sources) == 1:  # one origin: named once, in the head
        head, lines = f"Invalid config{_where(sources.pop(), ' ')}", [text for text, _ in found]
    else:
        head, lines = "Invalid config", [text + _where(source, " [", "]") for text, source in found]
    return f"{head}: " + lines[0] if len(lines) == 1 else f"{head}:\n  " + "\n  ".join(lines)


def _where(source: str, before: str, after: str = "") -> str:
    """'from --steps', 'from OPENTAU_STEPS' or 'in <file>' between `before` and `after`; '' for no source."""
    if not source:
        return ""
    return f"{before}{'from' if source.startswith(('--', 'OPENTAU_')) else 'in'} {source}{after}"


def load_config(
    config_path: str | Path | None = None,
    overrides: Mapping[str, str] | list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> TrainConfig:
    """JSON file < OPENTAU_* environment < overrides. Raises UserError with one readable message, naming where each
    bad value came from (the file, the OPENTAU_* variable or the `--key` flag)."""
    data: dict = {}
    origin = ""
    found: Path | None = None
    cwd = Path.cwd()
    if config_path is not None:
        found = find_config_file(config_path)
        # Relative paths mean where they were given (config/paths.py): the file's own base, then this command's cwd.
        data = resolve_paths(read_json(found), paths_base(found))
        origin = f" in {found}"
    data = deep_merge(data, resolve_paths(env_values(environ), cwd))
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    origins = env_origins(environ)
    for key, raw in (overrides or {}).items():
        value = coerce_value(key, raw)
        _set_dotted(data, key, resolve_value(key, value, cwd) if is_path_key(key) else value)
        origins[key] = f"--{key}"
        for other in [k for k in origins if k.startswith(key + ".")]:  # the flag replaced that whole section
            del origins[other]
    if found is not None:
        data["config_path"] = str(found)
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, origin, origins)) from None
