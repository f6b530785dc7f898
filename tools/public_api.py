#!/usr/bin/env python3
"""Lists the public names amp's headers declare, one per line: NAME<TAB>HEADER.

Public: declared at namespace scope in namespace amp or a nested namespace
(amp::float8), never inside a namespace named `detail` (at any depth) and
never a class member: classes, structs, unions and enums (definitions and
forward declarations), aliases, variables and variable templates, free
functions and function templates; and the macros #defined with a name that
starts with AMP_ but not AMP_DETAIL_. Explicit specializations are the same
name. A name declared in several headers is listed once, with the header
that defines its primary template (a body or an `=`); failing that, the one
that declares it; failing that, the first that specializes it.

A small tokenizer, not a C++ parser: comments, string and character literals
and preprocessor lines are dropped (both branches of an #if are read), then
braces are tracked on a stack that knows what each `{` opens.
    public_api.py [INCLUDE_DIR]      (default: include)
"""
import os
import re
import sys

CLASS_KEYS = {"class", "struct", "union", "enum"}
PAREN_KEYWORDS = {"decltype", "noexcept", "alignas", "sizeof", "alignof", "__attribute__"}
TOKEN = re.compile(r"\s+|([A-Za-z_]\w*|\d[\w.']*|::|->|<<|<=|>=|==|!=|&&|\|\||\S)")
IDENT = re.compile(r"[A-Za-z_]\w*$")
DEFINE = re.compile(r"#\s*define\s+([A-Za-z_]\w*)")
DIGITS = re.compile(r"\b\d[\w']*$")  # a number so far: its ' is a digit separator
RAW_STRING = re.compile(r'(?:u8|[uUL])?R"([^(\s]*)\(')


def strip(text):
    """`text` without comments, literals (each left as "" or '') and
    preprocessor lines; and the names it #defines."""
    out, macros, i, n = [], [], 0, len(text)
    line_start = True  # only whitespace since the last newline
    while i < n:
        c = text[i]
        after_word = i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")
        raw = RAW_STRING.match(text, i) if c in "uULR" and not after_word else None
        if c == "#" and line_start:  # a preprocessor line, with its \ continuations
            m = DEFINE.match(text, i)
            if m:
                macros.append(m.group(1))
            while i < n and text[i] != "\n":
                i += 2 if text[i] == "\\" else 1
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("/*", i):
            i = text.index("*/", i + 2) + 2
            out.append(" ")
        elif raw:
            i = text.index(")" + raw.group(1) + '"', raw.end()) + len(raw.group(1)) + 2
            out.append('""')
        elif c == '"' or (c == "'" and not DIGITS.search(text, max(0, i - 32), i)):  # not 1'000
            i += 1
            while text[i] != c:
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append(c + c)
        else:
            line_start = c == "\n" or (line_start and c.isspace())
            out.append(c)
            i += 1
    return "".join(out), macros


def skip_group(toks, i, close):
    """The index just past the group that toks[i] opens; in a <...> group,
    angle brackets inside (...) do not count."""
    open_, depth, paren = toks[i], 0, 0
    for j in range(i, len(toks)):
        if open_ == "<" and toks[j] in ("(", ")"):
            paren += 1 if toks[j] == "(" else -1
        elif paren == 0 and toks[j] in (open_, close):
            depth += 1 if toks[j] == open_ else -1
            if depth == 0:
                return j + 1
    return len(toks)


def name_before(toks, p):
    """The declarator name that ends just before toks[p] (past a <...>
    specialization list), or None when it is qualified (X::f) or absent."""
    j = p - 1
    if j >= 0 and toks[j] == ">":
        depth = 0
        while j >= 0:
            depth += {">": 1, "<": -1}.get(toks[j], 0)
            j -= 1
            if depth == 0:
                break
    if j < 0 or not IDENT.match(toks[j]) or (j > 0 and toks[j - 1] in ("::", "~")):
        return None
    return toks[j]


def unprefixed(toks):
    """The statement without its template headers and leading [[attributes]],
    and whether it is an explicit specialization (template <>)."""
    spec = False
    while True:
        if toks[:2] == ["template", "<"]:
            spec = spec or toks[2] == ">"
            toks = toks[skip_group(toks, 1, ">"):]
        elif toks[:2] == ["[", "["]:
            toks = toks[skip_group(toks, 0, "]"):]
        else:
            return toks, spec


def declarator(toks):
    """For a statement that is not a class: (kind, index) of the first
    top-level `(` ("func") or `=`, `{}`, `[`, end ("var"), or ("operator", i)."""
    i = 0
    while i < len(toks):
        t = toks[i]
        if t == "operator":
            return "operator", i
        if t == "<" and i and IDENT.match(toks[i - 1]):
            i = skip_group(toks, i, ">")
        elif (t == "(" and i and toks[i - 1] in PAREN_KEYWORDS) or toks[i:i + 2] == ["[", "["]:
            i = skip_group(toks, i, ")" if t == "(" else "]")
        elif t in ("(", "=", "{}", "["):
            return ("func" if t == "(" else "var"), i
        else:
            i += 1
    return "var", len(toks)


def declaration(stmt):
    """(name, is_definition, is_specialization) for one namespace-scope
    statement (its tokens up to `;`, a brace group as "{}"), or None."""
    toks, spec = unprefixed(stmt)
    if not toks or toks[0] in ("template", "static_assert", "namespace", "friend"):
        return None  # an explicit instantiation or an assertion
    if toks[:2] == ["extern", "template"]:
        return None  # an explicit instantiation declaration
    if toks[0] == "}":  # the declarators after a class body: struct X {} x;
        return (name_before(toks, len(toks)), True, spec) if len(toks) > 1 else None
    if toks[0] in CLASS_KEYS:
        k = 1
        while toks[k] in ("class", "struct") or toks[k:k + 2] == ["[", "["]:
            k = k + 1 if toks[k] != "[" else skip_group(toks, k, "]")
        if not IDENT.match(toks[k]) or toks[k + 1:k + 2] == ["::"]:
            return None  # anonymous, or qualified
        return toks[k], "{}" in toks, spec or toks[k + 1:k + 2] == ["<"]
    if toks[0] == "using":
        if toks[1] == "namespace":
            return None
        return toks[1] if toks[2] == "=" else toks[-1], True, spec  # an alias, or using ns::name;
    if toks[0] == "typedef":
        return name_before(toks, len(toks)), True, spec
    kind, i = declarator(toks)
    if kind == "operator":
        j = i + 3 if toks[i + 1] == "(" else toks.index("(", i)
        name = "operator" + "".join(toks[i + 1:j]) if toks[i - 1:i] != ["::"] else None
        kind, i = "func", j
    else:
        name = name_before(toks, i)
    spec = spec or toks[i - 1:i] == [">"]  # f<int>(...), x_v<int> = ...
    if kind == "var":  # a definition unless extern
        return (name, toks[0] != "extern", spec) if name else None
    after = toks[skip_group(toks, i, ")"):]  # a function: a definition with a body or = delete
    return (name, "{}" in after or "=" in after, spec) if name else None


def opens(stmt):
    """What a `{` after this namespace-scope statement opens."""
    toks = unprefixed(stmt)[0]
    if toks[:1] == ["namespace"] or toks[:2] == ["inline", "namespace"] or toks[:1] == ["extern"]:
        return "ns"  # extern "C" { is a namespace without a name
    if toks[:1] and toks[0] in CLASS_KEYS:
        return "class"
    kind, i = declarator(toks)
    if kind == "func":
        after = toks[skip_group(toks, i, ")"):]  # past the parameters: X::X(...) : a{1}, b(2) {
        member_init = ":" in after and (IDENT.match(toks[-1]) or toks[-1] == ">")
        return "init" if member_init else "func"
    return "func" if kind == "operator" else "init"


def scan(path, header, found):
    """Adds the public names of the header at `path` to found[name]."""
    code, macros = strip(open(path, encoding="utf-8").read())
    for m in macros:
        if m.startswith("AMP_") and not m.startswith("AMP_DETAIL_"):
            found.setdefault(m, []).append((0, header))
    toks = [m.group(1) for m in TOKEN.finditer(code) if m.group(1)]
    stack, stmt = [], []  # one entry per open `{`: ("ns", [names]) or (kind, None)

    def record():
        ns = [n for kind, names in stack if kind == "ns" for n in names]
        decl = declaration(stmt) if stmt else None
        if decl and decl[0] and ns[:1] == ["amp"] and "detail" not in ns and "" not in ns:
            name, is_def, spec = decl  # rank: primary definition, declaration, specialization
            found.setdefault("::".join(ns + [name]), []).append((2 * spec + (not is_def), header))

    for i, t in enumerate(toks):
        if stack and stack[-1][0] != "ns":  # inside a class, function or initializer
            if t == "{":
                stack.append(("block", None))
            elif t == "}":
                kind = stack.pop()[0]
                if kind == "func":
                    stmt = []
                elif kind == "class":
                    stmt = ["}"]  # what follows is the body's declarators, if any
        elif t == "}":
            if not stack:
                sys.exit(f"public_api.py: {path}: unbalanced braces")
            stack.pop()
            stmt = []
        elif t == ";":
            record()
            stmt = []
        elif t != "{":
            stmt.append(t)
        else:
            kind = opens(stmt)
            if kind == "ns":
                names = [s for s in stmt if IDENT.match(s) and s not in ("inline", "namespace", "extern")]
                stack.append(("ns", names or ([] if stmt[0] == "extern" else [""])))
                stmt = []
                continue
            stmt.append("{}")
            if kind != "init":
                record()
            head = unprefixed(stmt)[0]
            if head[:1] == ["enum"] and head[1] not in ("class", "struct"):  # unscoped: its enumerators too
                depth, prev = 0, ","
                for e in toks[i + 1:skip_group(toks, i, "}") - 1]:
                    if depth == 0 and prev == "," and IDENT.match(e):
                        stmt = [e, "=", "0"]
                        record()
                    depth += (e in ("(", "[", "{")) - (e in (")", "]", "}"))
                    prev = e if depth == 0 else prev
            stack.append((kind, None))
    if stack:
        sys.exit(f"public_api.py: {path}: unbalanced braces")


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "include"
    found = {}
    for dirpath, dirs, files in os.walk(root, followlinks=True):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".h"):
                path = os.path.join(dirpath, f)
                scan(path, os.path.relpath(path, root), found)
    rows = [(min(places)[1], k, name) for k, (name, places) in enumerate(found.items())]
    for header, _, name in sorted(rows):  # by header, then in the order first seen
        print(f"{name}\t{header}")


if __name__ == "__main__":
    main()
