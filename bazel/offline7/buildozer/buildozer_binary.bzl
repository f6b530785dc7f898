"""Stand-in for buildozer's module extension (bazel_tools names it; only `bazel mod tidy` uses it)."""

def _stub_repo_impl(ctx):
    ctx.file("BUILD.bazel", "")

_stub_repo = repository_rule(implementation = _stub_repo_impl)

def _buildozer_binary_impl(_ctx):
    _stub_repo(name = "buildozer_binary")

buildozer_binary = module_extension(implementation = _buildozer_binary_impl)
