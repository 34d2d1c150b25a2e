"""Lists Rust functions longer than a bound (default 80 lines), by brace matching.

Usage: python3 scripts/long_functions.py [--max 80] PATH...   (folders are searched for *.rs)
Counts from the `fn` line to its closing brace; strings, chars and comments are skipped.
"""
import argparse
import pathlib
import re

FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+\"C\"\s+)?fn\s+(\w+)")


def strip(line, state):
    """The line without comments and string contents; state carries a block comment."""
    out, i = [], 0
    while i < len(line):
        if state["block"]:
            j = line.find("*/", i)
            if j < 0:
                return "".join(out)
            state["block"], i = False, j + 2
            continue
        two = line[i:i + 2]
        if two == "//":
            break
        if two == "/*":
            state["block"], i = True, i + 2
            continue
        c = line[i]
        if c == '"':
            j = i + 1
            while j < len(line) and line[j] != '"':
                j += 2 if line[j] == "\\" else 1
            i = j + 1
            continue
        if c == "'" and re.match(r"'(\\.|[^\\'])'", line[i:]):
            i += len(re.match(r"'(\\.|[^\\'])'", line[i:]).group(0))
            continue
        out.append(c)
        i += 1
    return "".join(out)


def functions(path):
    lines = path.read_text().splitlines()
    state = {"block": False}
    code = [strip(l, state) for l in lines]
    for start, line in enumerate(code):
        m = FN.match(line)
        if not m:
            continue
        depth, opened = 0, False
        for end in range(start, len(code)):
            for c in code[end]:
                if c == "{":
                    depth, opened = depth + 1, True
                elif c == "}":
                    depth -= 1
            if opened and depth == 0:
                yield m.group(7), start + 1, end - start + 1
                break
            if not opened and code[end].rstrip().endswith(";"):
                break


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max", type=int, default=80)
    ap.add_argument("paths", nargs="+")
    args = ap.parse_args()
    found = []
    for p in map(pathlib.Path, args.paths):
        files = sorted(p.rglob("*.rs")) if p.is_dir() else [p]
        for f in files:
            for name, line, length in functions(f):
                if length > args.max:
                    found.append((length, f"{f}:{line}", name))
    for length, where, name in sorted(found, reverse=True):
        print(f"{length:5d}  {where}  {name}")
    print(f"{len(found)} functions over {args.max} lines")


if __name__ == "__main__":
    main()
