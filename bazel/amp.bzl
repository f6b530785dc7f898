"""Build macros shared by tests, examples and benchmarks."""

load("@libtorch//:version.bzl", "CXX_STD")
load("//bazel:compile_check.bzl", "compile_check")

# Our own headers are included with -I (warnings on); LibTorch, gtest and
# Boost are -isystem, so -Werror applies to amp's code only. The standard is
# the one the LibTorch line needs (bazel/local_deps.bzl decides it).
AMP_WARNINGS = ["-Wall", "-Wextra", "-Werror"]

# The standard a target that includes amp (and LibTorch) needs on this line:
# load("@amp//bazel:amp.bzl", "AMP_STD_COPTS") and copts = AMP_STD_COPTS.
AMP_STD_COPTS = ["-std=" + CXX_STD]
AMP_COPTS = AMP_STD_COPTS + AMP_WARNINGS

# Tests and the programs only tests run are built at -O0: no test result
# depends on the optimizer (the parity twins are bitwise at -O0 as at -O2, and
# amp's own kernels keep one FP contract at every level), and -O0 compiles a
# test ~30% faster. Examples, benchmarks and the demo keep .bazelrc's -O2.
AMP_TEST_COPTS = ["-O0"]

# LibTorch, GoogleTest and GoogleMock precompiled (//tools:test_pch at -O0,
# //tools:program_pch at -O2; bazel/pch.bzl): each unit loads them instead of
# parsing them (a third of a test unit's compile). -Winvalid-pch (an error
# here) says when flags drift and g++ would parse them again.
def _pch(testonly):
    name = "test_pch" if testonly else "program_pch"
    return struct(
        copts = ["-include", "amp_%s.h" % name, "-Winvalid-pch"],
        deps = ["//tools:" + name],
    )

def amp_cc_test(name, srcs, deps = [], size = "small", timeout = None, copts = [], **kw):
    native.cc_test(
        name = name,
        srcs = srcs,
        copts = AMP_COPTS + AMP_TEST_COPTS + _pch(True).copts + copts,
        deps = ["//:amp", "@libtorch", "@system_libs//:hana", "@system_libs//:gtest_main", "@system_libs//:gmock"] +
               _pch(True).deps + deps,
        size = size,
        timeout = timeout,
        **kw
    )

def amp_cc_test_group(name, srcs, hdrs = [], **kw):
    """One gtest binary for several test files (a layer's): a generated
    translation unit #includes them, so LibTorch's headers are parsed and its
    templates instantiated once for the group, not once per file. Each file
    keeps its helpers in a namespace of its own (named after the file), so the
    files can share the unit; a compile error still names the file and line.
    A part runs alone with --test_filter (gtest's filter, e.g. 'Fabric.*')."""
    native.cc_library(
        name = name + "_parts",
        textual_hdrs = srcs + hdrs,
        testonly = True,
    )
    pkg = native.package_name()
    native.genrule(
        name = name + "_unit",
        outs = [name + "_unit.cc"],
        cmd = "printf '%s\\n' " + " ".join([
            "'#include \"%s\"'" % ((pkg + "/" if pkg else "") + s)
            for s in srcs
        ]) + " >$@",
        testonly = True,
    )
    amp_cc_test(name = name, srcs = [name + "_unit.cc"], deps = [name + "_parts"], **kw)

def amp_cc_binary(name, srcs, deps = [], copts = [], testonly = False, **kw):
    """A program that includes amp. testonly = True: a program only tests run
    (a parity binary, a multi-process case runner), built like a test (-O0)."""
    native.cc_binary(
        name = name,
        srcs = srcs,
        copts = AMP_COPTS + (AMP_TEST_COPTS if testonly else []) + _pch(testonly).copts + copts,
        testonly = testonly,
        deps = ["//:amp", "@libtorch", "@system_libs//:hana"] + _pch(testonly).deps + deps,
        **kw
    )

def amp_cc_benchmark(name, srcs, deps = [], copts = [], tags = [], **kw):
    """A Google Benchmark program, -O2; built on request only (`manual`):
    bench/BUILD.bazel's bench_compile_test keeps it compiling."""
    amp_cc_binary(name = name, srcs = srcs, deps = ["@system_libs//:benchmark_main"] + deps, copts = copts,
                  tags = tags + ["manual"], **kw)

def compile_check_test(name, script, args, data, size = "small"):
    """A check that only compiles, split so that no test timeout covers the
    compiler: a build action (bazel/compile_check.bzl) runs `script args` and
    records its output and verdict; the test reports that record and fails
    with the check's status. On a loaded machine the compiles are slower, not
    failed. The action reruns only when a file it reads changes (of amp's
    headers, those its sources can reach)."""
    compile_check(
        name = name + "_compile",
        script = script,
        args = args,
        data = data,
        log = name + ".compile.log",
        testonly = True,
    )
    native.sh_test(
        name = name,
        srcs = ["//tools:compile_check_report.sh"],
        args = ["$(location :%s.compile.log)" % name],
        data = [":%s.compile.log" % name],
        size = size,
    )

def compile_fail_test(name, src, expect = None, deps = []):
    """`src` must fail with -DAMP_SHOULD_FAIL, its first error a static
    assertion carrying the message of the source's `// expect:` line (or
    `expect`, when given). Its passing twin (`src` as is) is checked with the
    package's others by compile_fail_twins_test."""
    args = ["--pch=$(location //tools:pch/torch_pch.h)", "$(location %s)" % src, "$(location @libtorch//:compile_flags.txt)"]
    if expect:
        args.append(expect)
    compile_check_test(
        name = name,
        script = "//tools:compile_fail_test.sh",
        args = args,
        data = [src, "//:amp_headers", "@libtorch//:compile_flags.txt", "//tools:pch/torch_pch.h", "//tools:pch/torch_pch.h.gch"] + deps,
    )

def compile_fail_twins_test(name, srcs):
    """The passing twins of the compile_fail_tests `srcs` (each compiles as is,
    without AMP_SHOULD_FAIL), compiled to the end in one unit
    (tools/compile_units.sh --unit-only; each rule's failing build checks what
    its source includes)."""
    compile_check_test(
        name = name,
        script = "//tools:compile_units.sh",
        args = ["--unit-only", "--pch=$(location //tools:pch/torch_pch.h)", "$(location @libtorch//:compile_flags.txt)"] +
               ["$(location %s)" % s for s in srcs],
        data = srcs + ["//tools:one_unit.sh", "@libtorch//:compile_flags.txt", "//tools:pch/torch_pch.h", "//tools:pch/torch_pch.h.gch"],
    )

def header_self_contained_tests(headers):
    """One test per public header (call from the root package, which owns
    include/): each header compiles on its own, warning-free."""
    for hdr in headers:
        compile_check_test(
            name = "header_" + hdr[len("include/"):].replace("/", "_").replace(".", "_"),
            script = "//tools:header_test.sh",
            args = ["--aten-pch=$(location //tools:pch/aten_pch.h)", "$(location @libtorch//:compile_flags.txt)", hdr],
            data = [":amp_headers", "@libtorch//:compile_flags.txt", "//tools:pch/aten_pch.h", "//tools:pch/aten_pch.h.gch"],
        )

def bazel_consumer_test(name):
    """tests/bazel_consumer_test.sh: the README's Bazel recipe, with Bzlmod
    where the Bazel running it has it (Debian 14's 7.7; a Bazel with Bzlmod
    knows native.module_name), with a WORKSPACE otherwise (Debian 12's and
    13's 4.2.3)."""
    native.sh_test(
        name = name,
        srcs = ["bazel_consumer_test.sh"],
        args = ["--bzlmod" if hasattr(native, "module_name") else "--workspace"],
        data = [
            "//:MODULE.bazel",
            "//:README.md",
            "//:amp_headers",
            "readme_recipes.sh",
        ],
        timeout = "long",  # a whole Bazel build inside the test
        tags = ["local"],
    )
