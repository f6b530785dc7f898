"""Finds LibTorch and the Debian-packaged test libraries on this machine.

@libtorch: Debian's libtorch-dev under /usr by default; set LIBTORCH_PREFIX to a
downloaded LibTorch or a pip wheel's torch/ directory (the one holding include/
and lib/). CUDA libraries are linked when the prefix has them, and then
AMP_LIBTORCH_HAS_CUDA is defined. The repository also exports
`compile_flags.txt` (the -std/-isystem/-D flags a plain compiler invocation
needs), used by the compile-fail and header tests, and `version.bzl`
(TORCH_VERSION, HAS_CUDA, CXX_STD) for build logic.

The C++ standard is chosen here, once for every line: amp itself needs C++17;
LibTorch's headers need C++20 from CXX20_SINCE on (ATen/ATen.h:
`#error C++20 or later compatible compiler is required to use ATen.`,
pytorch#178150, first released in 2.14). bazel/amp.bzl's macros and the
compile checks read it from here.
"""

CXX20_SINCE = (2, 14)

def _first_existing(ctx, paths):
    for p in paths:
        if ctx.path(p).exists:
            return p
    return None

def _libtorch_impl(ctx):
    prefix = ctx.os.environ.get("LIBTORCH_PREFIX", "")
    if prefix:
        inc = prefix + "/include"
        libdir = prefix + "/lib"
    else:
        inc = "/usr/include"
        libdir = _first_existing(ctx, ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"])
    api = inc + "/torch/csrc/api/include"
    if not ctx.path(api + "/torch/torch.h").exists or not libdir or not ctx.path(libdir).exists:
        fail("amp: LibTorch not found (looked for %s/torch/torch.h). Install it with " % api +
             "`apt-get install --no-install-recommends libtorch-dev` or set LIBTORCH_PREFIX " +
             "to a LibTorch directory that holds include/ and lib/ (e.g. the output of " +
             "`python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))'`).")

    # Only torch's own header trees are linked in, so that -isystem never
    # shadows unrelated system headers.
    for d in ["ATen", "c10", "caffe2", "torch"]:
        if ctx.path(inc + "/" + d).exists:
            ctx.symlink(inc + "/" + d, "include/" + d)
    ctx.symlink(api, "api/include")

    libs = ["-ltorch", "-ltorch_cpu", "-lc10"]
    defines = []
    has_cuda = ctx.path(libdir + "/libtorch_cuda.so").exists
    if has_cuda:
        libs = ["-ltorch", "-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10"]
        defines = ["AMP_LIBTORCH_HAS_CUDA=1"]
    linkopts = ["-L" + libdir, "-Wl,-rpath," + libdir, "-Wl,--no-as-needed"] + libs + ["-Wl,--as-needed", "-pthread"]

    # The version, for build logic that depends on it (the C++ standard, tests
    # of rules that only hold before a given LibTorch).
    # torch/version.h holds the numbers up to 2.x; later releases include
    # torch/headeronly/version.h from it (2.14 does).
    major, minor = None, None
    for f in [api + "/torch/version.h", inc + "/torch/headeronly/version.h"]:
        if not ctx.path(f).exists:
            continue
        for line in ctx.read(f).splitlines():
            parts = [p for p in line.replace("\t", " ").split(" ") if p]
            if len(parts) == 3 and parts[0] == "#define" and parts[1] == "TORCH_VERSION_MAJOR":
                major = int(parts[2])
            if len(parts) == 3 and parts[0] == "#define" and parts[1] == "TORCH_VERSION_MINOR":
                minor = int(parts[2])
    if major == None or minor == None:
        fail("amp: no TORCH_VERSION_MAJOR/MINOR in %s/torch/version.h or %s/torch/headeronly/version.h" % (api, inc))
    cxx_std = "c++20" if (major, minor) >= CXX20_SINCE else "c++17"
    ctx.file("version.bzl", "TORCH_VERSION = (%d, %d)\nHAS_CUDA = %s\nCXX_STD = \"%s\"\n" % (major, minor, has_cuda, cxx_std))

    # Plain compiler invocations need the standard, and torch's headers when
    # they are not under a default system include dir.
    flags = ["-std=" + cxx_std, "-isystem", str(ctx.path("include")), "-isystem", str(ctx.path("api/include"))]
    for d in defines:
        flags.append("-D" + d)
    ctx.file("compile_flags.txt", "\n".join(flags) + "\n")

    ctx.file("WORKSPACE", "workspace(name = \"libtorch\")\n")
    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])
exports_files(["compile_flags.txt"])
cc_library(
    name = "libtorch",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh", "api/include/**/*.h"], allow_empty = True),
    includes = ["include", "api/include"],
    defines = {defines},
    linkopts = {linkopts},
)
""".format(defines = repr(defines), linkopts = repr(linkopts)))

libtorch_repository = repository_rule(
    implementation = _libtorch_impl,
    environ = ["LIBTORCH_PREFIX"],
    local = True,
)

def _system_libs_impl(ctx):
    """GoogleTest, Google Benchmark, Boost.Hana and CLI11 from Debian's packages."""
    missing = []
    for f, pkg in [("/usr/include/gtest/gtest.h", "libgtest-dev"),
                   ("/usr/include/gmock/gmock.h", "libgmock-dev"),
                   ("/usr/include/benchmark/benchmark.h", "libbenchmark-dev"),
                   ("/usr/include/boost/hana.hpp", "libboost-dev"),
                   ("/usr/include/CLI/CLI.hpp", "libcli11-dev")]:
        if not ctx.path(f).exists:
            missing.append(pkg)
    if missing:
        fail("amp: missing Debian packages: %s. Run `tools/dev test` (it installs them) or " % ", ".join(missing) +
             "`apt-get install --no-install-recommends %s`." % " ".join(missing))
    ctx.file("WORKSPACE", "workspace(name = \"system_libs\")\n")
    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])
# Headers live in /usr/include, a default system include directory.
cc_library(name = "hana")
cc_library(name = "cli11")
cc_library(name = "gtest", linkopts = ["-lgtest", "-pthread"])
cc_library(name = "gtest_main", deps = [":gtest"], linkopts = ["-lgtest_main"])
cc_library(name = "gmock", deps = [":gtest"], linkopts = ["-lgmock"])
cc_library(name = "benchmark", linkopts = ["-lbenchmark", "-pthread"])
cc_library(name = "benchmark_main", deps = [":benchmark"], linkopts = ["-lbenchmark_main"])
""")

system_libs_repository = repository_rule(implementation = _system_libs_impl, local = True)
