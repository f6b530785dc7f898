"""Offline stand-ins for the repositories Bazel 4.2.3 would otherwise download.

Debian's bazel-bootstrap 4.2.3 has no network here. Its default WORKSPACE suffix
asks for @rules_cc, @rules_java and @remote_coverage_tools; declaring these
local stand-ins first makes `bazel clean --expunge && bazel test //...` work
without a single download. They forward to the native rules built into 4.2.3.
"""

def _rules_cc_impl(ctx):
    ctx.file("WORKSPACE", "workspace(name = \"rules_cc\")\n")
    ctx.file("BUILD.bazel", "")
    ctx.file("cc/BUILD.bazel", """
package(default_visibility = ["//visibility:public"])
alias(name = "toolchain_type", actual = "@bazel_tools//tools/cpp:toolchain_type")
""")
    ctx.file("cc/defs.bzl", """
def cc_binary(**kw): native.cc_binary(**kw)
def cc_library(**kw): native.cc_library(**kw)
def cc_test(**kw): native.cc_test(**kw)
def cc_import(**kw): native.cc_import(**kw)
def cc_proto_library(**kw): native.cc_proto_library(**kw)
def cc_toolchain(**kw): native.cc_toolchain(**kw)
def cc_toolchain_suite(**kw): native.cc_toolchain_suite(**kw)
def objc_library(**kw): native.objc_library(**kw)
def objc_import(**kw): native.objc_import(**kw)
""")

rules_cc_standin = repository_rule(implementation = _rules_cc_impl)

def _rules_java_impl(ctx):
    ctx.file("WORKSPACE", "workspace(name = \"rules_java\")\n")
    ctx.file("BUILD.bazel", "")
    ctx.file("java/BUILD.bazel", "")
    ctx.file("java/defs.bzl", """
def java_binary(**kw): native.java_binary(**kw)
def java_library(**kw): native.java_library(**kw)
def java_import(**kw): native.java_import(**kw)
def java_test(**kw): native.java_test(**kw)
def java_plugin(**kw): native.java_plugin(**kw)
def java_toolchain(**kw): native.java_toolchain(**kw)
def java_runtime(**kw): native.java_runtime(**kw)
def java_proto_library(**kw): native.java_proto_library(**kw)
def java_lite_proto_library(**kw): native.java_lite_proto_library(**kw)
""")

rules_java_standin = repository_rule(implementation = _rules_java_impl)

def _coverage_tools_impl(ctx):
    ctx.file("WORKSPACE", "workspace(name = \"remote_coverage_tools\")\n")
    ctx.file("noop.sh", "#!/bin/sh\nexit 0\n", executable = True)
    ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])
sh_binary(name = "coverage_report_generator", srcs = ["noop.sh"])
sh_binary(name = "lcov_merger", srcs = ["noop.sh"])
""")

remote_coverage_tools_standin = repository_rule(implementation = _coverage_tools_impl)
