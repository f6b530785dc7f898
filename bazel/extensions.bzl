"""Bzlmod: LibTorch and Debian's test libraries as repositories (see local_deps.bzl)."""

load("//bazel:local_deps.bzl", "libtorch_repository", "system_libs_repository")

def _local_deps_impl(_ctx):
    libtorch_repository(name = "libtorch")
    system_libs_repository(name = "system_libs")

local_deps = module_extension(implementation = _local_deps_impl)
