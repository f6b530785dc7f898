#!/usr/bin/env python3
"""The members docs/reference.md must list, and the ones it does list.

    reference_members.py headers INCLUDE_DIR CLASS...   CLASS<TAB>member, from the headers
    reference_members.py doc REFERENCE_MD               CLASS<TAB>member, from the page

headers: for each class named (amp::Trainer, amp::float8::X), its primary
definition in a header under INCLUDE_DIR (namespace amp; a class in a
`detail` namespace only where the page names it so, as the class template
behind public aliases),
and its public members: member functions and constructors (overloads are one
name; destructors, copy and move members and `= delete`d ones are left out), TORCH_ARG options (the
fluent setter and getter: after one, as in LibTorch, the section is private),
data members, member aliases and nested types. Inherited members are the base
class's own section. A class that is not found is an error.

doc: each section of the page whose heading holds `amp::Name` in backticks
(up to the next heading of any level); in it, each table row whose first cell
starts with code (one or more spans, comma-separated): the member name in each
signature (the identifier before its first `(` past any `template <...>`,
`operator...`, a `using` alias's name, or the last identifier of a field).

A tokenizer, not a C++ parser: tools/public_api.py's (comments, literals and
preprocessor lines dropped).
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from public_api import IDENT, PAREN_KEYWORDS, TOKEN, skip_group, strip  # noqa: E402

CLASS_KEYS = ("class", "struct", "union")


def tokens(code):
    return [m.group(1) for m in TOKEN.finditer(code) if m.group(1)]


def skip_template_heads(toks, i):
    while toks[i:i + 2] == ["template", "<"]:
        i = skip_group(toks, i + 1, ">")
    return i


def statement_end(toks, i, end):
    """The index past the `;` that ends the statement at i (braces, parens skipped)."""
    while i < end and toks[i] != ";":
        i = skip_group(toks, i, {"(": ")", "{": "}", "[": "]"}[toks[i]]) if toks[i] in "({[" else i + 1
    return i + 1


def function_end(toks, i, end):
    """toks[i] is just past a function's parameter list: the index past its
    body or its `;` (a constructor's member initializers included), and whether
    it is `= delete`d."""
    while i < end and toks[i] not in ("{", ";", "=", ":"):
        i = skip_group(toks, i, ")") if toks[i] == "(" else i + 1
    if i >= end or toks[i] == ";":
        return i + 1, False
    if toks[i] == "=":
        j = statement_end(toks, i, end)
        return j, "delete" in toks[i:j]
    if toks[i] == ":":  # member initializers: name(...) or name{...}, separated by commas
        i += 1
        while i < end:
            while i < end and toks[i] not in ("(", "{"):
                i = skip_group(toks, i, ">") if toks[i] == "<" else i + 1
            i = skip_group(toks, i, ")" if toks[i] == "(" else "}")
            if i < end and toks[i] == ",":
                i += 1
                continue
            break
    return skip_group(toks, i, "}"), False


def class_members(toks, start, end, is_struct):
    """Public member names of the class body toks[start:end]."""
    public, found, i = is_struct, set(), start
    while i < end:
        t = toks[i]
        if t in ("public", "private", "protected") and toks[i + 1] == ":":
            public, i = t == "public", i + 2
            continue
        if t == ";":
            i += 1
            continue
        i = skip_template_heads(toks, i)
        t = toks[i]
        if t in ("friend", "static_assert"):
            j = i
            while toks[j] not in (";", "{"):
                j = skip_group(toks, j, ")") if toks[j] == "(" else j + 1
            i = skip_group(toks, j, "}") if toks[j] == "{" else j + 1
            continue
        if t == "TORCH_ARG":  # TORCH_ARG(T, name) = default;  public, and leaves the section private
            group_end = skip_group(toks, i + 1, ")")
            found.add(toks[group_end - 2])
            public, i = False, statement_end(toks, group_end, end)
            continue
        if t in CLASS_KEYS or t == "enum":
            j = i + 1
            while toks[j] in ("class", "struct") or toks[j:j + 2] == ["[", "["]:
                j = skip_group(toks, j, "]") if toks[j] == "[" else j + 1
            if public and IDENT.match(toks[j]):
                found.add(toks[j])
            i = statement_end(toks, j, end)
            continue
        if t == "using":
            if public and toks[i + 2] == "=":
                found.add(toks[i + 1])
            i = statement_end(toks, i, end)
            continue
        j = i  # a function or a data member: find its declarator
        while j < end:
            u = toks[j]
            if u == "operator":
                k = j + 3 if toks[j + 1] == "(" else toks.index("(", j + 1)
                name, j = "operator" + "".join(toks[j + 1:k]), k
                break
            if u == "<" and j > i and IDENT.match(toks[j - 1]):
                j = skip_group(toks, j, ">")
            elif u == "(" and toks[j - 1] in PAREN_KEYWORDS:
                j = skip_group(toks, j, ")")
            elif u in ("(", "=", ";", "{", ",", "["):
                name = toks[j - 1]
                break
            else:
                j += 1
        if toks[j] == "(":
            after, deleted = function_end(toks, skip_group(toks, j, ")"), end)
            params = toks[j + 1:skip_group(toks, j, ")") - 1]
            special = (toks[j - 2:j - 1] == ["~"] or name == "operator=" or  # destructor, copy/move
                       params in (["const", name, "&"], [name, "&&"]))
            if public and not deleted and not special and (IDENT.match(name) or name.startswith("operator")):
                found.add(name)
            i = after
        else:
            if public and IDENT.match(name):
                found.add(name)
            i = statement_end(toks, j, end)
    return found


def classes_in(path):
    """{qualified name: (tokens, body start, body end, is_struct)} of the
    primary class definitions at namespace scope of one header."""
    toks = tokens(strip(open(path, encoding="utf-8").read())[0])
    out, stack, stmt, i = {}, [], [], 0
    while i < len(toks):
        t = toks[i]
        if t == "{":
            head = stmt + ["{"]
            head = head[skip_template_heads(head, 0):]
            if head[:1] == ["namespace"] or head[:2] == ["inline", "namespace"]:
                names = [s for s in stmt if IDENT.match(s) and s not in ("inline", "namespace")]
                stack.append(names or [""])
                stmt, i = [], i + 1
                continue
            close = skip_group(toks, i, "}")
            if head[:1] and head[0] in CLASS_KEYS and len(head) > 2 and IDENT.match(head[1]) and head[2] in (
                    "{", ":", "final"):
                ns = [n for names in stack for n in names]
                if ns[:1] == ["amp"]:
                    out["::".join(ns + [head[1]])] = (toks, i + 1, close - 1, head[0] != "class")
            stmt, i = [], close
            continue
        if t == "}":
            stack.pop()
            stmt, i = [], i + 1
            continue
        if t == ";":
            stmt, i = [], i + 1
            continue
        stmt.append(t)
        i += 1
    return out


def from_headers(include, wanted):
    classes = {}
    for dirpath, dirs, files in os.walk(include, followlinks=True):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".h"):
                for name, found in classes_in(os.path.join(dirpath, f)).items():
                    classes.setdefault(name, found)
    status = 0
    for name in wanted:
        if name not in classes:
            print(f"reference_members.py: no definition of {name} in {include}", file=sys.stderr)
            status = 1
            continue
        toks, start, end, is_struct = classes[name]
        for member in sorted(class_members(toks, start, end, is_struct)):
            print(f"{name}\t{member}")
    return status


HEADING = re.compile(r"^#+ ")
CLASS_IN_HEADING = re.compile(r"`(amp::(?:\w+::)*\w+)")
ROW = re.compile(r"^\|\s*(`[^`]+`(?:\s*,\s*`[^`]+`)*)")  # the first cell's leading code spans


def member_name(sig):
    toks = tokens(sig)
    i = skip_template_heads(toks, 0)
    toks = toks[i:]
    if toks[:1] == ["using"]:
        return toks[1]
    for j, t in enumerate(toks):
        if t == "operator":
            k = j + 3 if toks[j + 1:j + 2] == ["("] else toks.index("(", j + 1)
            return "operator" + "".join(toks[j + 1:k])
    j = 0
    while j < len(toks):
        if toks[j] == "<" and j and IDENT.match(toks[j - 1]):
            j = skip_group(toks, j, ">")
        elif toks[j] == "(" and j and toks[j - 1] in PAREN_KEYWORDS:
            j = skip_group(toks, j, ")")
        elif toks[j] in ("(", "=") and j:
            return toks[j - 1]
        else:
            j += 1
    idents = [t for t in toks if IDENT.match(t)]
    return idents[-1] if idents else sig


def from_doc(path):
    section = None
    for line in open(path, encoding="utf-8"):
        if HEADING.match(line):
            m = CLASS_IN_HEADING.search(line)
            section = m.group(1) if m else None
        elif section:
            m = ROW.match(line)
            for sig in re.findall(r"`([^`]+)`", m.group(1)) if m else []:
                print(f"{section}\t{member_name(sig)}")
    return 0


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "headers":
        return from_headers(sys.argv[2], sys.argv[3:])
    if len(sys.argv) == 3 and sys.argv[1] == "doc":
        return from_doc(sys.argv[2])
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main())
