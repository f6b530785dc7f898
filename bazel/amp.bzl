"""Build macros shared by tests, examples and benchmarks."""

# Our own headers are included with -I (warnings on); LibTorch, gtest and
# Boost are -isystem, so -Werror applies to amp's code only.
AMP_WARNINGS = ["-Wall", "-Wextra", "-Werror"]

def amp_cc_test(name, srcs, deps = [], size = "small", timeout = None, copts = [], **kw):
    native.cc_test(
        name = name,
        srcs = srcs,
        copts = AMP_WARNINGS + copts,
        deps = ["//:amp", "@libtorch", "@system_libs//:hana", "@system_libs//:gtest_main", "@system_libs//:gmock"] + deps,
        size = size,
        timeout = timeout,
        **kw
    )

def amp_cc_binary(name, srcs, deps = [], copts = [], **kw):
    native.cc_binary(
        name = name,
        srcs = srcs,
        copts = AMP_WARNINGS + copts,
        deps = ["//:amp", "@libtorch", "@system_libs//:hana"] + deps,
        **kw
    )

def amp_cc_benchmark(name, srcs, deps = [], copts = [], **kw):
    amp_cc_binary(name = name, srcs = srcs, deps = ["@system_libs//:benchmark_main"] + deps, copts = copts, **kw)

def compile_fail_test(name, src, expect = None, deps = []):
    """`src` must compile without AMP_SHOULD_FAIL (the passing twin) and fail
    with -DAMP_SHOULD_FAIL, its first error a static assertion carrying the
    message of the source's `// expect:` line (or `expect`, when given)."""
    args = ["$(location %s)" % src, "$(location @libtorch//:compile_flags.txt)"]
    if expect:
        args.append("'%s'" % expect.replace("'", "'\\''"))
    native.sh_test(
        name = name,
        srcs = ["//tools:compile_fail_test.sh"],
        args = args,
        data = [src, "//:amp_headers", "@libtorch//:compile_flags.txt"] + deps,
        size = "medium",
    )

def header_self_contained_tests(headers):
    """One sh_test per public header (call from the root package, which owns
    include/): each header compiles on its own, warning-free."""
    for hdr in headers:
        native.sh_test(
            name = "header_" + hdr[len("include/"):].replace("/", "_").replace(".", "_"),
            srcs = ["//tools:header_test.sh"],
            args = ["$(location @libtorch//:compile_flags.txt)", hdr],
            data = [":amp_headers", "@libtorch//:compile_flags.txt"],
            size = "small",
        )
