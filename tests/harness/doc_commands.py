"""The shell commands of README.md and docs/*.md, as tests/test_doc_commands.py reads and runs them.

A command is a line of a ```bash block (with its `\\` continuations), without its trailing comment. A command that
cannot run here says why in that comment, in brackets, with one of MARKS: `# Blackwell only [needs a GPU]`. A
block of quoted output that a command printed follows an HTML comment naming the command:
`<!-- output of: NGPU=8 ./run_train.sh --job.config_file configs/llama3_8b.toml --job.dry_run -->`; its figures are
checked against what the command prints now. Each block runs in a folder laid out as a fresh clone, of its own
unless an HTML comment before it names a command of an earlier block, whose folder (and outputs) it continues in:
`<!-- in the folder of: ./run_train.sh --checkpoint.enable --checkpoint.interval 10 --training.steps 20 -->`."""

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKS = ("needs a GPU", "needs several nodes", "needs the hub", "needs credentials", "needs your data",
         "run by .ci/run", "run by tests/test_restarts.py")
"""Why a documented command does not run in the suite: hardware, the network, a user's own files or accounts, or
.ci/run running it itself (the install, the suite, the dry run of every shipped config), or a test running it with
what it shows checked (a fault and the restart after it, which a shared launch could not host)."""
LAUNCHER_ENV = ("MAX_RESTARTS",)
"""What only run_train.sh's launcher reads: a shortened run that fails nothing needs no restart budget."""
MARK = re.compile(r"\[(" + "|".join(map(re.escape, MARKS)) + r")[^\]]*\]")
FENCE = re.compile(r"^```(\S*)\s*$")
OUTPUT_OF = re.compile(r"^<!-- output of: (.*) -->$")
IN_FOLDER_OF = re.compile(r"^<!-- in the folder of: (.*) -->$")


@dataclass(frozen=True)
class DocCommand:
    doc: Path
    line: int
    text: str
    """The command as a user pastes it, without its comment."""
    skip: str | None
    """Its mark (MARKS), or None when it runs here."""
    block: int
    """The line of its block's fence: commands of one block share a folder."""
    folder_of: str | None = None
    """The command of an earlier block whose folder this block continues in, if any."""

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class QuotedOutput:
    doc: Path
    line: int
    command: str
    lines: list[str]


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: the comment starts at a `#` outside quotes, at the start or after a space."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def doc_commands(doc: Path) -> list[DocCommand]:
    """Every command of `doc`'s bash blocks, in order."""
    commands: list[DocCommand] = []
    in_bash = in_block = False
    pending: tuple[int, list[str], list[str]] | None = None  # first line, code parts, comments
    block, folder_of, previous = 0, None, ""
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if fence:
            in_bash, in_block = (not in_block and fence.group(1) == "bash"), not in_block
            if in_bash:
                continuing = IN_FOLDER_OF.match(previous.strip())
                block, folder_of = number, continuing.group(1) if continuing else None
            previous = line
            continue
        previous = line
        if not in_bash:
            continue
        code, comment = split_comment(line)
        if pending is None:
            if not code:
                continue
            pending = (number, [], [])
        continued = code.endswith("\\")
        pending[1].append(code.removesuffix("\\").strip())
        pending[2].append(comment)
        if not continued:
            first, parts, comments = pending
            mark = MARK.search(" ".join(comments))
            commands.append(DocCommand(doc, first, " ".join(parts), mark.group(0)[1:-1] if mark else None, block,
                                       folder_of))
            pending = None
    return commands


def quoted_outputs(doc: Path) -> list[QuotedOutput]:
    """Every block that follows an `<!-- output of: COMMAND -->` line."""
    found = []
    lines = doc.read_text().splitlines()
    for number, line in enumerate(lines):
        marker = OUTPUT_OF.match(line.strip())
        if marker:
            assert FENCE.match(lines[number + 1]), f"{doc}:{number + 1}: a code block must follow {line!r}"
            end = next(i for i in range(number + 2, len(lines)) if FENCE.match(lines[i]))
            found.append(QuotedOutput(doc, number + 1, marker.group(1), lines[number + 2:end]))
    return found


@dataclass(frozen=True)
class Invocation:
    """How a command starts Titan's trainer: ./run_train.sh (env, NGPU, CONFIG_FILE) or python train.py."""

    env: dict[str, str]
    processes: int
    argv: list[str]
    """train.py's arguments, the config file first."""


def trainer_invocation(text: str) -> Invocation | None:
    """The trainer run a command starts, or None for any other command (scripts, the dry-run module, pip)."""
    words = shlex.split(text)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if words[:1] == ["./run_train.sh"]:
        for name in LAUNCHER_ENV:
            env.pop(name, None)
        config = env.pop("CONFIG_FILE", "configs/debug_model.toml")
        return Invocation(env, int(env.pop("NGPU", "1")), ["--job.config_file", config, *words[1:]])
    if words[:2] == ["python", "train.py"]:
        return Invocation(env, 1, words[2:])
    return None


SHORT_STEPS = "1"
"""The steps a training command runs here: one, logged, that takes the job's every stage (a later step takes the
same ones)."""
SHORT_SEQ_LEN = "64"
"""The sequence length a training command runs at here: the parity tests' (tests/test_parallel.py), which take every
layout's and converter's path (context parallel's shards and float8's token counts still divide), at a quarter of the
debug config's cost per step."""
MAX_CHECKPOINT_STEPS = 20
"""A checkpointing command of at most this many steps runs them all: the docs go on from its step folders."""


def shortened(argv: list[str]) -> list[str]:
    """`argv` with sequences of SHORT_SEQ_LEN tokens and --training.steps cut to SHORT_STEPS (a later flag wins),
    except for the steps of a checkpointing command that names at most MAX_CHECKPOINT_STEPS."""
    shorter = [*argv, "--training.seq_len", SHORT_SEQ_LEN]
    steps = [int(argv[i + 1]) for i, arg in enumerate(argv[:-1]) if arg == "--training.steps"]
    if "--checkpoint.enable" in argv and steps and steps[-1] <= MAX_CHECKPOINT_STEPS:
        return shorter
    return [*shorter, "--training.steps", SHORT_STEPS]


def shortened_script(text: str) -> str:
    """A script's command in its cheapest form: a benchmark's --steps cut to 2 and its --repeats to 1 (its runs still
    alternate, once each)."""
    text = re.sub(r"(--steps )(\d+)", lambda m: m.group(1) + min(m.group(2), "2", key=int), text)
    return re.sub(r"(--repeats )(\d+)", lambda m: m.group(1) + "1", text)


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def shape(text: str) -> str:
    """A line with its numbers masked and its runs of spaces (a table's padding) made one."""
    return " ".join(NUMBER.sub("#", text).split())


def figure_mismatches(quoted: list[str], output: str, rel: float) -> list[str]:
    """Each quoted line that the output lacks: no output line reads the same with its numbers masked, or the numbers
    of every such line differ by more than `rel` (relative)."""
    shapes: dict[str, list[list[float]]] = {}
    for line in output.splitlines():
        text = re.sub(r"^\d\d:\d\d:\d\d (\[rank\d+\] )?[A-Z]+ ", "", line).strip()
        shapes.setdefault(shape(text), []).append(numbers(text))
    problems = []
    for line in quoted:
        text = line.strip()
        if not text or text == "...":
            continue
        candidates = shapes.get(shape(text))
        want = numbers(text)
        if not candidates:
            problems.append(f"no output line reads like {text!r}")
        elif not any(all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want)) for got in candidates):
            problems.append(f"{text!r}: the command now prints {candidates}")
    return problems


def numbers(text: str) -> list[float]:
    return [float(match.replace(",", "")) for match in NUMBER.findall(text)]
