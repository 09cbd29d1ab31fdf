// The torch headers most of csrc includes, precompiled once per build
// (CMakeLists.txt: target_precompile_headers). Parsing them dominated every
// translation unit's compile time (<ATen/ATen.h> alone takes ~11 s at -O3);
// sources still include what they use, so nothing depends on this list.
#pragma once

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>
