// What every test unit and example parses first, precompiled once per
// LibTorch line and optimization level (//tools:test_pch, //tools:program_pch;
// bazel/pch.bzl): LibTorch, GoogleTest and GoogleMock. Not amp's headers, so a
// change to amp never rebuilds it; not the header self-containment check,
// which must see only what each header includes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
