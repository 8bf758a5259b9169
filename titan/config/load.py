"""Build a JobConfig from defaults, then the TOML job file, then command-line flags (tyro)."""

import ast
import dataclasses
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from titan.config.errors import ConfigError
from titan.config.job import JobConfig
from titan.config.mixture import format_mixture_entry
from titan.models.families import FAMILIES

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")
# How users reach Titan's flags; tyro names it in usage lines and in "For full helptext, run ... --help".
PROGRAM = "./run_train.sh"
# Values a switch accepts when a user writes it TOML-style (`--compile.enable true`).
SWITCH_VALUES = {"true": True, "false": False}
FLAG_ALIASES = {"--training.compile": "--compile.enable"}
"""Earlier spellings of a field's flag -> its flag: each reads the same on the command line (with its off switch,
--training.no_compile) and as a TOML key ([training] compile)."""


def field_docstrings(section: type) -> dict[str, str]:
    """Each field's docstring (the string right after its annotated assignment) in `section`'s source, cleaned."""
    body = ast.parse(textwrap.dedent(inspect.getsource(section))).body[0].body
    return {node.target.id: inspect.cleandoc(after.value.value) for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


def flowing(doc: str) -> str:
    """`doc` with its line breaks inside paragraphs removed, so that --help wraps it to the terminal's width."""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in doc.split("\n\n"))


def flow_field_help(config: type) -> None:
    """Hand tyro every section field's docstring as flowing paragraphs (tyro.conf.arg(help=...)). From the
    docstring itself, tyro keeps each line break before an indented line, which is every continuation line of a
    field docstring, so --help wrapped them raggedly."""
    for section in dataclasses.fields(config):
        annotations = section.type.__annotations__
        for name, doc in field_docstrings(section.type).items():
            annotations[name] = Annotated[annotations[name], tyro.conf.arg(help=flowing(doc))]


flow_field_help(JobConfig)
DESCRIPTION = f"Titan: pretrain LLMs of the families {', '.join(FAMILIES)} (--model.name). Flags override the TOML " \
              f"file in --job.config_file."
"""The head of --help."""


def parse_args(argv: list[str], program: str = PROGRAM) -> JobConfig:
    """Parse `argv` (without the program name) into a JobConfig. User mistakes raise ConfigError;
    tyro itself reports unknown flags and badly typed flag values, with exit code 2. `program` heads --help."""
    if not any(arg in ("-h", "--help") for arg in argv):
        check_flag_names(argv, program)
    config_file = find_config_file(argv)
    base = load_toml(Path(config_file)) if config_file else JobConfig()
    cfg = tyro.cli(JobConfig, args=with_flag_aliases(switches_without_values(argv)), default=base,
                   use_underscores=True, prog=program, description=DESCRIPTION)
    split_comma_lists(cfg)
    return cfg


def switch_flags() -> set[str]:
    """`--section.name` of every boolean field, and of every alias of one."""
    flags = {f"--{section.name}.{name}" for section in dataclasses.fields(JobConfig)
             for name, hint in typing.get_type_hints(section.type).items() if hint is bool}
    return flags | {alias for alias, flag in FLAG_ALIASES.items() if flag in flags}


def with_flag_aliases(argv: list[str]) -> list[str]:
    """`argv` with every alias (FLAG_ALIASES), and its off switch, written as the field's own flag."""
    aliases = {**FLAG_ALIASES, **{negated(alias): negated(flag) for alias, flag in FLAG_ALIASES.items()}}
    rewritten = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        rewritten.append(aliases[name] + sep + value if name in aliases else arg)
    return rewritten


def switches_without_values(argv: list[str]) -> list[str]:
    """Rewrite `--x.flag true|false` and `--x.flag=true|false` (as TOML users type them) into tyro's switches
    `--x.flag` / `--x.no_flag`. Titan takes no positional arguments, so a word right after a switch is its value."""
    switches = switch_flags()
    rewritten: list[str] = []
    i = 0
    while i < len(argv):
        name, sep, value = argv[i].partition("=")
        if name in switches and not sep and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            i += 1
            sep, value = "=", argv[i]
        if name not in switches or not sep:
            rewritten.append(argv[i])
        elif value.lower() in SWITCH_VALUES:
            rewritten.append(name if SWITCH_VALUES[value.lower()] else negated(name))
        else:
            raise ConfigError(f"{name} is a switch and can't take {value!r}: write {name} (or {name} true) to turn "
                              f"it on, {negated(name)} (or {name} false) to turn it off.")
        i += 1
    return rewritten


def negated(flag: str) -> str:
    """tyro's off switch for a boolean flag: --compile.enable -> --compile.no_enable."""
    section, name = flag.removeprefix("--").split(".", 1)
    return f"--{section}.no_{name}"


def find_config_file(argv: list[str]) -> str | None:
    """The value of --job.config_file, read before tyro so the TOML can become tyro's defaults."""
    found = None
    for i, arg in enumerate(argv):
        name, sep, value = arg.partition("=")
        if name in CONFIG_FILE_FLAGS:
            if sep:
                found = value
            elif i + 1 < len(argv):
                found = argv[i + 1]
    return found


def load_toml(path: Path) -> JobConfig:
    """Read a TOML job file into a JobConfig, reporting every unknown name and wrong type at once."""
    data = read_toml(path)
    problems: list[str] = []
    section_types = {f.name: f.type for f in dataclasses.fields(JobConfig)}
    move_aliased_keys(data, section_types, path, problems)
    sections = {}
    for section_name, table in data.items():
        if section_name not in section_types:
            problems.append(f"{path}: unknown section [{section_name}]{suggest(section_name, section_types)}")
            continue
        if not isinstance(table, dict):
            problems.append(f"{path}: {section_name} must be a table ([{section_name}]), got a value.")
            continue
        sections[section_name] = build_section(section_types[section_name], section_name, table, path, problems)
    if problems:
        raise ConfigError(problems)
    cfg = JobConfig(**sections)
    cfg.job.config_file = str(path)
    return cfg


def move_aliased_keys(data: dict[str, Any], section_types: dict[str, type], path: Path, problems: list[str]) -> None:
    """Move each aliased key of a TOML job file ([training] compile) to its field's table ([compile] enable), in
    the section dataclasses `section_types` (by table name); both at once is a problem appended to `problems`."""
    for alias, flag in FLAG_ALIASES.items():
        (alias_table, alias_key), (table, key) = (name.removeprefix("--").split(".", 1) for name in (alias, flag))
        if not isinstance(data.get(alias_table), dict) or alias_key not in data[alias_table]:
            continue
        value = data[alias_table].pop(alias_key)
        _, expected = convert_value(value, typing.get_type_hints(section_types[table])[key])
        target = data.setdefault(table, {})
        if expected is not None:  # named as the user wrote it
            problems.append(f"{path}: [{alias_table}] {alias_key} = {value!r} must be {expected}.")
        elif isinstance(target, dict) and key in target:
            problems.append(f"{path}: [{alias_table}] {alias_key} and [{table}] {key} are one field ({flag}, of "
                            f"which {alias} is an alias): keep one.")
        elif isinstance(target, dict):
            target[key] = value


def read_toml(path: Path) -> dict[str, Any]:
    """The tables of a TOML job file, UTF-8 with or without a byte-order mark (Windows editors write one)."""
    flag = f"--job.config_file {str(path)!r}"
    if path.is_dir():
        raise ConfigError(f"{flag} is a folder, not a TOML file. Pass a file such as configs/debug_model.toml.")
    if not path.exists():
        raise ConfigError(f"{flag} does not exist. Pass an existing TOML file, e.g. configs/debug_model.toml.")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as e:
        raise ConfigError(f"{flag} can't be read ({e.strerror}). Check the file's permissions.") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{flag} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}). "
                          f"TOML files must be UTF-8: save it as UTF-8.") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}. Fix the file at that line.") from None


def build_section(cls: type, section_name: str, table: dict[str, Any], path: Path, problems: list[str]) -> Any:
    """One section dataclass from its TOML table; bad keys and values are appended to `problems`."""
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in table.items():
        if key not in hints:
            problems.append(f"{path}: unknown key {key!r} in [{section_name}]{suggest(key, hints)}")
            continue
        if (section_name, key) == ("training", "mixture") and isinstance(value, list):
            value = mixture_strings(value, f"{path}: [training] mixture", problems)
        converted, expected = convert_value(value, hints[key])
        if expected is not None:
            problems.append(f"{path}: [{section_name}] {key} = {value!r} must be {expected}.")
            continue
        values[key] = converted
    return cls(**values)


MIXTURE_TABLE_KEYS = ("dataset", "path", "weight")


def mixture_strings(entries: list[Any], where: str, problems: list[str]) -> list[Any]:
    """--training.mixture entries with each TOML table ({dataset = "jsonl", path = "a.jsonl", weight = 3}) written
    as the string the command line takes ("jsonl:a.jsonl=3"), which validate() then checks like any other. A
    malformed table is appended to `problems` (named by its position) and left out."""
    converted = []
    for number, entry in enumerate(entries, start=1):
        if not isinstance(entry, dict):
            converted.append(entry)
            continue
        name = f"{where} entry {number} {entry!r}"
        unknown = [key for key in entry if key not in MIXTURE_TABLE_KEYS]
        dataset, path, weight = entry.get("dataset"), entry.get("path"), entry.get("weight")
        if unknown:
            problems.append(f"{name} has unknown key(s) {', '.join(map(repr, unknown))}. Keys: "
                            f"{', '.join(MIXTURE_TABLE_KEYS)}.")
        elif not isinstance(dataset, str) or not (path is None or isinstance(path, str)):
            problems.append(f"{name} needs dataset, and optionally path, as strings "
                            f'(e.g. {{dataset = "jsonl", path = "data/code.jsonl", weight = 3}}).')
        elif not isinstance(weight, (int, float)) or isinstance(weight, bool):
            problems.append(f"{name} needs a number weight (e.g. weight = 1).")
        else:
            converted.append(format_mixture_entry(dataset, path, weight))
    return converted


def convert_value(value: Any, hint: Any) -> tuple[Any, str | None]:
    """Check a TOML value against a field's type. Returns (value, None) or (None, what was expected)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        # `X | None`: TOML has no null, so a present value must be an X.
        inner = next(a for a in typing.get_args(hint) if a is not type(None))
        return convert_value(value, inner)
    if origin is Literal:
        choices = typing.get_args(hint)
        return (value, None) if value in choices else (None, f"one of {', '.join(map(repr, choices))}")
    if origin is list:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list) and all(isinstance(v, str) for v in items):
            return items, None
        return None, "a list of strings"
    if hint is bool:
        return (value, None) if isinstance(value, bool) else (None, "true or false")
    if hint is int:
        return (value, None) if isinstance(value, int) and not isinstance(value, bool) else (None, "an integer")
    if hint is float:
        # TOML integers have no size limit in tomllib; one beyond float's range is not a usable number either.
        ok = isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)
                                          and abs(value) < 2**1023)
        return (float(value), None) if ok else (None, "a number")
    if hint is str:
        return (value, None) if isinstance(value, str) else (None, "a string")
    raise TypeError(f"JobConfig field type {hint} has no TOML conversion")


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions from a to b."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def closest(name: str, valid: typing.Iterable[str]) -> list[str]:
    """The valid names nearest to `name` by edit distance (several when they tie), if within a third of its length:
    the typo `--training.step` gets --training.steps, not a longer name that merely shares its letters."""
    scored = [(edit_distance(name, candidate), candidate) for candidate in valid]
    best = min((distance for distance, _ in scored), default=0)
    return sorted(candidate for distance, candidate in scored if distance == best <= max(2, len(name) // 3))


def suggest(name: str, valid: typing.Iterable[str]) -> str:
    """' Did you mean X?' for the nearest valid name, or a list of valid names."""
    valid = list(valid)
    near = closest(name, valid)
    if near:
        return f". Did you mean {near[0]!r}?"
    return f". Valid names: {', '.join(valid)}."


def check_flag_names(argv: list[str], program: str) -> None:
    """Raise one ConfigError naming every `--section.field` flag that is not Titan's, with the nearest ones."""
    known = {f"--{section.name}.{name}" for section in dataclasses.fields(JobConfig)
             for name in typing.get_type_hints(section.type)}
    known |= set(FLAG_ALIASES) | {negated(flag) for flag in switch_flags()}
    problems = []
    for arg in argv:
        flag = arg.partition("=")[0]
        if not flag.startswith("--") or flag.replace("-", "_").replace("__", "--", 1) in known:
            continue
        near = closest(flag, known)
        hint = f" Did you mean {' or '.join(near)}?" if near else f" See {program} --help for every field."
        problems.append(f"{flag} is not a Titan flag.{hint}")
    if problems:
        raise ConfigError(problems)


def split_comma_lists(cfg: JobConfig) -> None:
    """Accept `--model.converters float8,mx` as well as `float8 mx`, as torchtitan does.
    Part of parsing: runs before validation, never after."""
    for section_field in dataclasses.fields(cfg):
        section = getattr(cfg, section_field.name)
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                setattr(section, f.name, [part.strip() for v in value for part in v.split(",") if part.strip()])


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML that load_toml reads back to the same JobConfig.
    None fields are left out: TOML has no null and every optional field defaults to None."""
    lines: list[str] = []
    for section_field in dataclasses.fields(cfg):
        lines.append(f"[{section_field.name}]")
        section = getattr(cfg, section_field.name)
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if value is not None:
                lines.append(f"{f.name} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """TOML spelling of a str, bool, int, float or list of those."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML spelling for {type(value).__name__}")
