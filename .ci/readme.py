"""The README's quick start, read from the README itself so CI runs what a user reads.

    python3 .ci/readme.py command N        # the Nth ```bash block of '## Quick start' (1: train, 2: tests)
    python3 .ci/readme.py same N 'CMD'     # exit 1 unless that block is CMD, verbatim (.ci/run runs CMD)
    python3 .ci/readme.py check LOG        # LOG (the first command's output) shows the README's run

`check`: every `step N | loss X` line the README prints after the first command is printed by the run,
its loss within 1% (the README's losses come from one CPU; another ISA's fp32 reductions move the
fourth digit after 200 steps, a wrong recipe, data set or init moves the first), and the final
checkpoint is committed. Exit 1 naming the first line that differs.
"""
import re
import sys

README = "README.md"


def quick_start() -> str:
    text = open(README).read()
    start = text.index("## Quick start")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def blocks(section: str) -> list[tuple[str, str]]:
    """The fenced blocks in order: (language, body)."""
    return re.findall(r"^```(\w*)\n(.*?)^```", section, re.S | re.M)


def command(n: int) -> str:
    return [body for lang, body in blocks(quick_start()) if lang == "bash"][n - 1].strip()


def check(log_path: str) -> int:
    fenced = blocks(quick_start())
    first = next(i for i, (lang, _) in enumerate(fenced) if lang == "bash")
    expected = fenced[first + 1][1] if first + 1 < len(fenced) and not fenced[first + 1][0] else ""
    log = open(log_path, errors="replace").read()
    step = re.compile(r"^step +(\d+) \| loss ([\d.]+)", re.M)
    got = {int(s): float(v) for s, v in step.findall(log)}
    want = [(int(s), float(v)) for s, v in step.findall(expected)]
    if not want:
        print(f"{README}: no step line after the first command", file=sys.stderr)
        return 1
    for s, v in want:
        if s not in got:
            print(f"the quick start printed no step {s} (the README shows it)", file=sys.stderr)
            return 1
        if abs(got[s] - v) > 0.01 * abs(v):
            print(f"step {s}: loss {got[s]} where the README shows {v} (more than 1% apart)", file=sys.stderr)
            return 1
    last = max(s for s, _ in want)
    if not re.search(rf"^\[checkpoint\] step {last} committed", log, re.M):
        print(f"the quick start committed no checkpoint at step {last}", file=sys.stderr)
        return 1
    print(f"quick start: steps {', '.join(str(s) for s, _ in want)} as the README shows (loss within 1%), "
          f"checkpoint at step {last} committed")
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "command":
        print(command(int(sys.argv[2])))
    elif sys.argv[1] == "same":
        if command(int(sys.argv[2])) != sys.argv[3]:
            sys.exit(f"{README}'s quick-start command {sys.argv[2]} is not the one .ci/run runs:\n  README: "
                     f"{command(int(sys.argv[2]))}\n  .ci/run: {sys.argv[3]}\nmake them one again")
    elif sys.argv[1] == "check":
        sys.exit(check(sys.argv[2]))
    else:
        sys.exit(__doc__)
