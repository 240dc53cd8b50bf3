"""What the docs quote: image references, and the commands a reader would copy.

A command is found in a fenced or indented code block, or in inline backticks, where it
starts the snippet (after `$ `, environment assignments, or a shell `&&` / `;` / `|`):
- `meshspeed SUB ...` (also `.venv/bin/meshspeed`);
- `python path/to/script.py ...` (any `python`, `python3`, `.venv/bin/python`);
- `python -m package.module ...` for this repository's packages.
Each is a `Command(kind, target, options, source)`: kind "meshspeed", "script" or
"module"; the options are the `--long` flags quoted before the end of the command (for
`meshspeed run` / `autotune`, before the launched script's path).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(```|~~~)")
IMAGE_MD = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE_HTML = re.compile(r"<img\s[^>]*src=[\"']([^\"']+)[\"']", re.IGNORECASE)
INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")
SHELL_BREAKS = {"&&", "||", ";", "|"}
SHELL_ENDS = {">", ">>", "2>&1", "&", "2>", "#", "<"}
REPO_PACKAGES = ("meshspeed", "benchmarks", "examples", "tests")


@dataclass(frozen=True)
class Command:
    kind: str  # "meshspeed", "script" or "module"
    target: str  # the subcommand, the script's path from the repo root, or the module
    options: tuple[str, ...]
    source: str  # "docs/x.md:LINE"


def doc_files() -> list[Path]:
    """docs/*.md and README.md."""
    return sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


def snippets(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every code block line (continuations joined) and every inline
    code span of a markdown file."""
    out: list[tuple[int, str]] = []
    prose: list[str] = []
    in_fence, pending, pending_line = False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            prose.append("")
            continue
        indented = not in_fence and line.startswith("    ") and not line.lstrip().startswith(("- ", "* ", "|"))
        if pending and not (in_fence or indented):  # a block that ended on a continuation
            out.append((pending_line, pending))
            pending = ""
        if in_fence or indented:
            prose.append("")
            text = line.strip()
            if pending:
                text, number = pending + " " + text, pending_line
            if text.endswith("\\"):
                pending, pending_line = text[:-1].rstrip(), number
                continue
            pending = ""
            out.append((number, text))
        else:
            prose.append(line)
    text = "\n".join(prose)
    for match in INLINE.finditer(text):
        out.append((text.count("\n", 0, match.start()) + 1, match.group(1).replace("\n", " ")))
    return out


def _tokens(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=False)
    except ValueError:  # an unbalanced quote in prose-like code: plain words are enough here
        return text.split()


def _is_python(token: str) -> bool:
    return re.fullmatch(r"(\S*/)?python(3(\.\d+)?)?", token) is not None


def _command_at(tokens: list[str], source: str) -> Command | None:
    """The command that starts tokens[0], if it is one of the quoted kinds."""
    if not tokens:
        return None
    head, rest = tokens[0], tokens[1:]
    end = next((i for i, t in enumerate(rest) if t in SHELL_BREAKS or t in SHELL_ENDS or t.startswith(">")),
               len(rest))
    rest = rest[:end]
    if head.rsplit("/", 1)[-1] == "meshspeed" and rest and re.fullmatch(r"[a-z][a-z0-9-]*", rest[0]):
        args = rest[1:]  # `run`, `autotune`: options after the script are the script's
        first = next((i for i, t in enumerate(args) if not t.startswith("-") and t.endswith(".py")), len(args))
        args = args[:first]
        return Command("meshspeed", rest[0], _options(args), source)
    if re.fullmatch(r"(\./)?(benchmarks|examples)/[\w/]+\.py", head) and _options(rest):  # run as a path
        return Command("script", head.removeprefix("./"), _options(rest), source)
    if _is_python(head):
        while rest and rest[0] in ("-u", "-B", "-O", "-X") or (rest and rest[0].startswith("-W")):
            rest = rest[1:]
        if len(rest) >= 2 and rest[0] == "-m" and rest[1].split(".")[0] in REPO_PACKAGES:
            return Command("module", rest[1], _options(rest[2:]), source)
        if rest and rest[0].endswith(".py") and not rest[0].startswith("-"):
            return Command("script", rest[0].removeprefix("./"), _options(rest[1:]), source)
    return None


def _options(args: list[str]) -> tuple[str, ...]:
    found = []
    for arg in args:
        arg = arg.strip("[](){},")
        if re.fullmatch(r"--[A-Za-z][\w-]*(=.*)?", arg):
            found.append(arg.split("=", 1)[0])
    return tuple(found)


def commands_in(path: Path) -> list[Command]:
    """Every command quoted in the markdown file at `path`."""
    out = []
    rel = path.relative_to(REPO)
    for number, text in snippets(path):
        tokens = _tokens(text.lstrip("$ ").strip())
        starts = [0] + [i + 1 for i, t in enumerate(tokens) if t in SHELL_BREAKS]
        for start in starts:
            cut = tokens[start:]
            while cut and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", cut[0]):  # VAR=value before a command
                cut = cut[1:]
            cmd = _command_at(cut, f"{rel}:{number}")
            if cmd is not None:
                out.append(cmd)
    return out


def images_in(path: Path) -> list[tuple[str, Path]]:
    """(the reference as written, the file it points to) for each image a markdown file shows."""
    text = path.read_text()
    refs = IMAGE_MD.findall(text) + IMAGE_HTML.findall(text)
    return [(ref, (path.parent / ref.split("#")[0]).resolve()) for ref in refs if "://" not in ref]
