"""compile_check: a build action that runs a compile-only check and records
its output and verdict (bazel/amp.bzl's compile_check_test reports it).

The check lists every amp header as an input, but reruns only when one it can
reach changes: tools/unused_headers.py names the others for Bazel's
`unused_inputs_list` (as Bazel's own C++ compiles prune theirs with the
compiler's .d file). A change to amp/core/policy.h reruns the checks whose
sources reach it, not all of them."""

# Inputs read for their #includes (documents' C++ blocks included).
_SCANNED = (".h", ".hpp", ".cc", ".cpp", ".md")

def _compile_check_impl(ctx):
    log = ctx.outputs.log
    unused = ctx.actions.declare_file(ctx.label.name + ".unused")
    prunable = ctx.files.prunable
    prunable_paths = {f.path: True for f in prunable}
    targets = {t.label: t for t in ctx.attr.data + ctx.attr.prunable + [ctx.attr.script]}.values()
    args = []
    for a in ctx.attr.args:
        expanded = ctx.expand_location(a, targets = targets)
        args += expanded.split(" ") if "$(locations " in a else [expanded]  # one argument per file
    named = {a: True for a in args}
    roots = [
        f
        for f in ctx.files.data + prunable
        if f.path in named or (f.path not in prunable_paths and f.path.endswith(_SCANNED))
    ]
    headers_list = ctx.actions.declare_file(ctx.label.name + ".headers")
    roots_list = ctx.actions.declare_file(ctx.label.name + ".roots")
    ctx.actions.write(headers_list, "\n".join([f.path for f in prunable]) + "\n")
    ctx.actions.write(roots_list, "\n".join([f.path for f in roots]) + "\n")
    ctx.actions.run(
        executable = ctx.executable._runner,
        # The build's --copt values (.bazelrc's) reach the check's g++ as AMP_CXXFLAGS.
        arguments = [log.path, unused.path, ctx.file._scanner.path, headers_list.path, roots_list.path,
                     " ".join(ctx.fragments.cpp.copts + ctx.fragments.cpp.cxxopts), ctx.file.script.path] + args,
        inputs = depset([ctx.file.script, ctx.file._scanner, headers_list, roots_list] + ctx.files.data + prunable),
        outputs = [log, unused],
        unused_inputs_list = unused,
        mnemonic = "CompileCheck",
        progress_message = "Compile check %s" % ctx.label,
        use_default_shell_env = True,
    )
    return [DefaultInfo(files = depset([log]))]

compile_check = rule(
    implementation = _compile_check_impl,
    attrs = {
        "script": attr.label(allow_single_file = True, mandatory = True),
        "args": attr.string_list(),
        "data": attr.label_list(allow_files = True),
        "prunable": attr.label_list(allow_files = True, default = ["//:amp_headers"]),
        "log": attr.output(mandatory = True),
        "_runner": attr.label(default = "//tools:compile_check_run.sh", executable = True, cfg = "exec", allow_single_file = True),
        "_scanner": attr.label(default = "//tools:unused_headers.py", allow_single_file = True),
    },
    fragments = ["cpp"],
)
