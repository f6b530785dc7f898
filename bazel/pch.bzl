"""cc_pch: a header precompiled with exactly the flags of the cc targets that
load it (the C++ toolchain's, .bazelrc's --copt, and `copts`), so that g++
accepts it; a target loads it with `deps = [pch]` and `copts = ["-include",
NAME]` (NAME: the rule's `include_as`). g++ parses the header itself where
the .gch does not fit (-Winvalid-pch says so), so a mismatch costs time, never
a different result."""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

def _cc_pch_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    features = cc_common.configure_features(
        ctx = ctx,
        cc_toolchain = cc_toolchain,
        requested_features = ctx.features,
        unsupported_features = ctx.disabled_features,
    )
    deps = cc_common.merge_cc_infos(cc_infos = [d[CcInfo] for d in ctx.attr.deps]).compilation_context
    header = ctx.actions.declare_file(ctx.attr.name + "/" + ctx.attr.include_as)
    ctx.actions.expand_template(template = ctx.file.header, output = header, substitutions = {})
    gch = ctx.actions.declare_file(ctx.attr.name + "/" + ctx.attr.include_as + ".gch")
    variables = cc_common.create_compile_variables(
        feature_configuration = features,
        cc_toolchain = cc_toolchain,
        user_compile_flags = ctx.fragments.cpp.copts + ctx.fragments.cpp.cxxopts + ctx.attr.copts + ["-x", "c++-header"],
        source_file = header.path,
        output_file = gch.path,
        include_directories = deps.includes,
        quote_include_directories = deps.quote_includes,
        system_include_directories = deps.system_includes,
        preprocessor_defines = depset(transitive = [deps.defines]),
        use_pic = False,  # as the tests' and binaries' objects (.o, not .pic.o)
    )
    ctx.actions.run(
        executable = cc_common.get_tool_for_action(feature_configuration = features, action_name = "c++-compile"),
        arguments = cc_common.get_memory_inefficient_command_line(
            feature_configuration = features,
            action_name = "c++-compile",
            variables = variables,
        ),
        env = cc_common.get_environment_variables(
            feature_configuration = features,
            action_name = "c++-compile",
            variables = variables,
        ),
        inputs = depset([header], transitive = [deps.headers, cc_toolchain.all_files]),
        outputs = [gch],
        mnemonic = "CppPch",
        progress_message = "Precompiling %s" % ctx.attr.include_as,
    )
    return [DefaultInfo(files = depset([header, gch])), CcInfo(compilation_context = cc_common.create_compilation_context(
        headers = depset([header, gch]),
        quote_includes = depset([header.dirname]),
    ))]

cc_pch = rule(
    implementation = _cc_pch_impl,
    attrs = {
        "header": attr.label(allow_single_file = True, mandatory = True),
        "include_as": attr.string(mandatory = True),
        "copts": attr.string_list(),
        "deps": attr.label_list(providers = [CcInfo]),
        "_cc_toolchain": attr.label(default = "@bazel_tools//tools/cpp:current_cc_toolchain"),
    },
    fragments = ["cpp"],
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
)
