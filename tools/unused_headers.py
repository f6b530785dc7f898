#!/usr/bin/env python3
"""Which of amp's headers a compile-only check cannot have read.

    unused_headers.py HEADERS_LIST ROOTS_LIST > UNUSED_LIST

HEADERS_LIST: the check's inputs that may be pruned (amp's headers), one path
per line. ROOTS_LIST: its other inputs (sources, documents, helpers). Prints
the headers that no root reaches through `#include`s, for Bazel's
`unused_inputs_list` (bazel/compile_check.bzl): a change to one of them does
not run the check again. The answer errs one way only, towards "used": every
`#include` line counts (one under `#if 0` too, and `__has_include`), a quoted
include is resolved both beside its file and under include/, and a computed
`#include MACRO` marks every header used.
"""
import os
import re
import sys

HAS_INCLUDE = re.compile(r'__has_include\s*\(\s*["<]([^">]*)[">]')
INCLUDE = re.compile(r'^\s*#\s*include\s*(["<][^">]*[">]|.*)', re.M)


def main(headers_list, roots_list):
    with open(headers_list) as f:
        headers = [line.strip() for line in f if line.strip()]
    with open(roots_list) as f:
        roots = [line.strip() for line in f if line.strip()]
    # A header's key is its include spelling: the path after its last include/.
    by_key = {}
    for path in headers:
        i = path.rfind("include/")
        by_key[path[i + len("include/"):] if i >= 0 else path] = path
    header_paths = set(headers)
    used, todo = set(roots) & header_paths, list(roots)  # a root header is read
    seen = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        found = set(HAS_INCLUDE.findall(text))
        for m in INCLUDE.finditer(text):
            spelled = m.group(1).strip()
            if not spelled or spelled[0] not in "\"<":
                return  # a computed include: nothing can be called unused
            name = spelled[1:-1]
            found.add(name)
            found.add(os.path.normpath(os.path.join(os.path.dirname(path), name)))
        for name in found:
            header = by_key.get(name) or (name if name in header_paths else None)
            if header and header not in used:
                used.add(header)
                todo.append(header)
    for path in headers:
        if path not in used:
            print(path)


if __name__ == "__main__":
    main(*sys.argv[1:])
